"""service.shims.transformers_experts: transformers' conversion of MoE experts, read as a layout.

If one of these fails after a transformers upgrade, the assumption its name states no longer
holds: a per-expert MoE checkpoint would then fail the job's build (``weights_mismatch`` naming
``mlp.experts.gate_up_proj``), or the packed stacks the job streams would no longer be what
``from_pretrained`` loads (the job's reference check fails).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter

from service.shims.transformers_experts import packing, unpacking
from tests.fixtures.moe import MOE_ARCHITECTURES, MOE_FAMILIES


def _meta_model(family: str, experts: int = 4) -> torch.nn.Module:
    sizes = dict(MOE_FAMILIES[family])
    sizes["num_local_experts" if family == "mixtral" else "num_experts"] = experts
    config = AutoConfig.for_model(
        family, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, architectures=[MOE_ARCHITECTURES[family]],
        **sizes,
    )  # fmt: skip
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def _hub_names(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """What ``save_pretrained`` writes for ``model`` (per expert), from its meta state dict."""
    from transformers.core_model_loading import revert_weight_conversion

    meta = {n: torch.empty(p.shape, device="meta") for n, p in model.state_dict().items()}
    return {n: tuple(t.shape) for n, t in revert_weight_conversion(model, meta).items()}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_from_pretrained_packs_each_layers_experts_into_gate_up_and_down_stacks(
    family: str,
) -> None:
    """get_model_conversion_mapping + rename_source_key: every per-expert tensor goes to one of
    the layer's two stacks; gate and up join along dimension 1 (MergeModulelist(dim=0) then
    Concatenate(dim=1)), down is a stack alone (MergeModulelist(dim=0))."""
    model = _meta_model(family)
    saved = _hub_names(model)
    conversion = packing(model, list(saved))
    assert conversion is not None and conversion.packs
    modules = dict(model.state_dict())
    stacks = {s.packed: s for s in conversion.stacks}
    expected = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                for p in ("gate_up_proj", "down_proj")}  # fmt: skip
    assert set(stacks) == expected
    for name, stack in stacks.items():
        assert stack.experts == 4 and stack.concat_dim == 1
        assert len(stack.parts) == (2 if name.endswith("gate_up_proj") else 1)
        shapes = [saved[p[0]] for p in stack.parts]
        packed = (4, sum(s[0] for s in shapes), *shapes[0][1:])
        assert tuple(modules[name].shape) == packed
    renamed = {conversion.renamed.get(n, n) for n in saved if n not in
               {x for s in conversion.stacks for x in s.names()}}  # fmt: skip
    assert renamed | set(stacks) == set(modules)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_transformers_own_converter_computes_the_cat_of_stacks_the_stream_lays_out(
    family: str,
) -> None:
    """WeightConverter.convert (its operations, as from_pretrained runs them on collected
    tensors) equals ``torch.cat([torch.stack(experts of pattern p) for p], dim)``: the layout
    ``checkpoint.experts`` streams."""
    model = _meta_model(family)
    saved = _hub_names(model)
    conversion = packing(model, list(saved))
    assert conversion is not None
    converters = {
        p: c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)
        for p in c.source_patterns
    }  # fmt: skip
    from transformers.core_model_loading import rename_source_key

    gen = torch.Generator().manual_seed(0)
    for stack in conversion.stacks:
        tensors = {n: torch.randn(saved[n], generator=gen) for n in stack.names()}
        _, pattern = rename_source_key(stack.parts[0][0], [], list(converters.values()))
        converter = copy.deepcopy(converters[pattern])
        for p, names in zip(converter.source_patterns, stack.parts, strict=True):
            for n in names:
                converter.add_tensor(stack.packed, n, p, lambda t=tensors[n]: t)
        (got,) = converter.convert(stack.packed).values()
        got = got[0] if isinstance(got, list) else got
        want = torch.cat(
            [torch.stack([tensors[n] for n in names]) for names in stack.parts], stack.concat_dim
        )
        assert torch.equal(got, want), stack.packed


def test_experts_are_stacked_in_numeric_order_as_dot_natural_key_sorts_them() -> None:
    """core_model_loading.dot_natural_key: expert 10 comes after expert 9, not after 1."""
    model = _meta_model("qwen3_moe", experts=12)
    names = list(_hub_names(model))
    random.Random(0).shuffle(names)
    conversion = packing(model, names)
    assert conversion is not None
    for stack in conversion.stacks:
        for names_of_pattern in stack.parts:
            order = [int(n.split(".experts.")[1].split(".")[0]) for n in names_of_pattern]
            assert order == list(range(12))


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_revert_weight_conversion_names_each_expert_as_save_pretrained_writes_it(
    family: str,
) -> None:
    """revert_weight_conversion on meta tensors gives save_pretrained's per-expert names."""
    model = _meta_model(family)
    modules = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    conversion = unpacking(model, modules)
    assert conversion is not None and not conversion.packs
    served = {n for s in conversion.stacks for n in s.names()}
    served |= {conversion.renamed.get(n, n) for n in modules
               if n not in {s.packed for s in conversion.stacks}}  # fmt: skip
    assert served == set(_hub_names(model))
    if family == "mixtral":  # the Hub's Mixtral layout, router included
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in served
        assert "model.layers.0.block_sparse_moe.gate.weight" in served


def test_a_family_without_expert_stacks_has_nothing_to_convert() -> None:
    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    names = [n for n, _ in model.named_parameters()]
    assert packing(model, names) is None
    assert unpacking(model, {n: tuple(p.shape) for n, p in model.named_parameters()}) is None
