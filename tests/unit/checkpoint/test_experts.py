"""service.checkpoint.experts: a MoE checkpoint read in the other expert layout, piece by piece.

The stacks served must equal what transformers' modules hold (the in-memory model that
``save_pretrained`` wrote), for any element range read, and the parts served from a stored
stack must equal what ``save_pretrained`` writes per expert.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.checkpoint import open_checkpoint
from service.checkpoint.experts import (
    ExpertLayoutReader,
    StackGeometry,
    as_model_names,
    in_layout,
    stored_layout,
)
from service.errors import WeightsMismatch
from service.shims.transformers_experts import ExpertStack
from tests.fixtures.moe import save_moe


@pytest.mark.parametrize("concat_dim", [1, 2])
def test_the_geometry_walks_the_stack_as_torch_cat_of_stacks_lays_it_out(concat_dim: int) -> None:
    experts, shapes = 3, [(4, 5, 2), (4, 3, 2)] if concat_dim == 2 else [(4, 6), (2, 6)]
    names = tuple(tuple(f"p{p}.e{e}" for e in range(experts)) for p in range(2))
    gen = torch.Generator().manual_seed(0)
    parts = {n: torch.randn(shapes[p], generator=gen) for p in range(2) for n in names[p]}
    stack = ExpertStack("packed", names, concat_dim)
    want = torch.cat([torch.stack([parts[n] for n in group]) for group in names], concat_dim)
    geometry = StackGeometry.of_parts(stack, list(shapes), torch.float32)
    assert geometry.shape == tuple(want.shape)
    flat = want.reshape(-1)
    for start, count in [(0, geometry.numel), (7, 23), (geometry.numel - 5, 5)]:
        got = torch.cat([
            parts[name].reshape(-1)[first : first + n]
            for name, first, n in geometry.pieces(start, count)
        ])  # fmt: skip
        assert torch.equal(got, flat[start : start + count])
    for p, group in enumerate(names):
        for e, name in enumerate(group):
            numel = parts[name].numel()
            ranges = geometry.part_ranges(p, e, 1, numel - 2)
            got = torch.cat([flat[at : at + n] for at, n in ranges])
            assert torch.equal(got, parts[name].reshape(-1)[1 : numel - 1])
    # a stored stack is cut in equal parts, as transformers' Chunk cuts it
    equal = StackGeometry.of_parts(stack, [shapes[0]] * 2, torch.float32)
    assert StackGeometry.of_stack(stack, equal.shape, torch.float32) == equal


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_per_expert_tensors_are_served_as_the_models_stacks(family: str, tmp_path: Path) -> None:
    model = save_moe(family, tmp_path, "per_expert", hidden=16, tokenizer=False)
    modules = model.state_dict()
    with open_checkpoint(tmp_path) as ckpt:
        assert stored_layout(ckpt.reader, model) == "per_expert"
        reader = as_model_names(ckpt.reader, model)
        assert isinstance(reader, ExpertLayoutReader)
        infos = {i.name: i for i in reader.tensor_infos()}
        assert sorted(infos) == sorted(modules)  # the router renamed too (Mixtral)
        for name, want in modules.items():
            assert infos[name].shape == tuple(want.shape), name
            assert torch.equal(reader.read(name), want), name
        stack = "model.layers.1.mlp.experts.gate_up_proj"
        flat = modules[stack].reshape(-1)
        pieces = list(reader.iter_chunks(stack, max_bytes=100 * 4))
        assert max(p.numel() for p in pieces) == 100
        assert torch.equal(torch.cat(pieces), flat)
        out = torch.empty(333)
        reader.read_into(stack, 77, out)
        assert torch.equal(out, flat[77:410])
        regions = reader.regions(stack)
        assert regions is not None and len(regions) > 1
        raw = b"".join(r.path.read_bytes()[r.offset : r.offset + r.length] for r in regions)
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), flat)
        assert reader.region(stack) is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_stored_stacks_are_served_as_save_pretrained_writes_each_expert(
    family: str, tmp_path: Path
) -> None:
    save_moe(family, tmp_path / "packed", "packed", hidden=16, tokenizer=False)
    model = save_moe(family, tmp_path / "hub", "per_expert", hidden=16, tokenizer=False)
    hub = load_file(tmp_path / "hub" / "model.safetensors")
    with open_checkpoint(tmp_path / "packed") as ckpt:
        assert stored_layout(ckpt.reader, model) == "packed"
        assert in_layout(ckpt.reader, model, "packed") is ckpt.reader
        reader = in_layout(ckpt.reader, model, "per_expert")
        assert sorted(i.name for i in reader.tensor_infos()) == sorted(hub)
        for name, want in hub.items():
            assert torch.equal(reader.read(name), want), name
            region = reader.region(name)
            assert region is not None
            raw = region.path.read_bytes()[region.offset : region.offset + region.length]
            assert raw == want.contiguous().numpy().tobytes(), name


def test_experts_that_differ_in_shape_are_a_weights_mismatch(tmp_path: Path) -> None:
    model = save_moe("qwen3_moe", tmp_path, "per_expert", hidden=16, tokenizer=False)
    state = load_file(tmp_path / "model.safetensors")
    odd = "model.layers.0.mlp.experts.2.up_proj.weight"
    state[odd] = state[odd][:-1].contiguous()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with open_checkpoint(tmp_path) as ckpt, pytest.raises(WeightsMismatch, match="differ in shape"):
        as_model_names(ckpt.reader, model)


def test_a_model_without_expert_stacks_reads_the_checkpoint_as_it_is(tmp_path: Path) -> None:
    from tests.fixtures.models import build_tiny_llama

    model = build_tiny_llama()
    model.save_pretrained(str(tmp_path))
    with open_checkpoint(tmp_path) as ckpt:
        assert as_model_names(ckpt.reader, model) is ckpt.reader
        assert stored_layout(ckpt.reader, model) is None
        assert in_layout(ckpt.reader, model, "packed") is ckpt.reader
