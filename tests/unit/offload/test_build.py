"""Building on meta: no weight memory, the right class, and a faithful keys report."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest
import torch

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import NoModelConfig
from service.offload.build import build_meta_model, build_on_meta, build_phase, match_keys
from service.stage import InMemoryContext, Phase
from tests.fixtures.models import copy_tree, llama_70b_config
from tests.unit.offload.conftest import OpenModelFactory


def test_70b_llama_skeleton_builds_on_meta_without_weight_memory(settings: Settings) -> None:
    config = llama_70b_config()
    from transformers import LlamaForCausalLM

    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    model = build_meta_model(config, settings, torch.bfloat16, LlamaForCausalLM)
    rss_growth = psutil.Process().memory_info().rss - rss_before

    params = list(model.parameters())
    assert sum(p.numel() for p in params) > 69e9
    assert all(p.device.type == "meta" for p in params)
    # 70B bf16 would be 140 GB; the skeleton's Python objects are a few MB.
    assert rss_growth < 200 * 2**20


@pytest.mark.parametrize(("kind", "tied"), [("safetensors", False), ("bin", True)])
def test_llama_keys_match_with_tied_head_reported(
    tiny_checkpoint: object, open_model: OpenModelFactory, kind: str, tied: bool
) -> None:
    built = open_model(tiny_checkpoint("llama", kind, tied=tied)).built  # type: ignore[operator]
    assert built.architecture == "LlamaForCausalLM"
    assert built.keys.missing == [] and built.keys.unexpected == []
    assert built.keys.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert built.no_split_module_classes == ["LlamaDecoderLayer"]
    assert built.dtype == torch.float32
    report = built.report()
    assert report["parameters"] == sum(p.numel() for p in built.model.parameters())


def test_base_model_checkpoint_keys_are_renamed_into_a_head_model(
    llama_safetensors_dir: Path, open_model: OpenModelFactory, settings: Settings
) -> None:
    from transformers import LlamaModel

    m = open_model(llama_safetensors_dir)
    names = [i.name for i in m.ckpt.reader.tensor_infos()]
    config = m.built.model.config
    base = build_meta_model(config, settings, torch.float32, LlamaModel)
    report = match_keys(base, names)
    assert report.unexpected == ["lm_head.weight"]
    assert report.renamed["model.norm.weight"] == "norm.weight"
    assert report.missing == []


def test_missing_config_is_a_typed_result_not_a_crash(
    llama_safetensors_dir: Path, tmp_path: Path, ctx: InMemoryContext
) -> None:
    bare = copy_tree(llama_safetensors_dir, tmp_path / "bare", only=["model.safetensors"])
    with open_checkpoint(bare) as ckpt:
        with pytest.raises(NoModelConfig):
            build_on_meta(ckpt, ctx.settings)
        assert build_phase(ckpt, ctx.settings, ctx) is None
    assert ctx.details["model"]["buildable"] is False
    assert "config.json" in ctx.details["model"]["reason"]
    assert Phase.BUILD in ctx.phases_seen


def test_unknown_model_type_is_no_model_config(
    llama_safetensors_dir: Path, settings: Settings
) -> None:
    with open_checkpoint(llama_safetensors_dir) as ckpt:
        ckpt.config = {"model_type": "not-a-real-architecture", "auto_map": {"AutoModel": "x.Y"}}
        with pytest.raises(NoModelConfig, match="trust_remote_code"):
            build_on_meta(ckpt, settings)


def test_build_phase_publishes_the_model_section(
    bert_safetensors_dir: Path, ctx: InMemoryContext
) -> None:
    with open_checkpoint(bert_safetensors_dir) as ckpt:
        built = build_phase(ckpt, ctx.settings, ctx)
    assert built is not None
    model = ctx.details["model"]
    assert model["buildable"] is True
    assert model["architecture"] == "BertModel"
    assert model["keys"]["missing"] == []
    assert model["parameters"] == built.parameter_count


def test_auto_map_of_a_70b_skeleton_keeps_layers_whole_within_budget(settings: Settings) -> None:
    from transformers import LlamaForCausalLM

    from service.offload.device_map import auto_device_map, placed_bytes
    from service.offload.streaming import PAGE_BYTES

    config = llama_70b_config()
    model = build_meta_model(config, settings, torch.bfloat16, LlamaForCausalLM)
    budget = 20 * 2**30
    device_map = auto_device_map(model, budget, ["LlamaDecoderLayer"], torch.bfloat16)
    layers = {k: v for k, v in device_map.items() if k.startswith("model.layers.")}
    assert all(k.count(".") == 2 for k in layers)  # whole decoder layers, never their parts
    assert device_map["model.embed_tokens"] == "cpu"
    layer_bytes = sum(p.numel() for p in model.get_submodule("model.layers.0").parameters()) * 2
    embed_bytes = model.get_parameter("model.embed_tokens.weight").numel() * 2
    # 2.1 GB of embeddings, then as many 1.7 GB layers as fit beside one page
    fitting = (budget - PAGE_BYTES - embed_bytes) // layer_bytes
    assert list(layers.values()).count("cpu") == fitting == 11
    assert device_map["lm_head"] == "disk"
    totals = placed_bytes(model, device_map, torch.bfloat16)
    assert totals["cpu"] + PAGE_BYTES <= budget
    assert totals["cpu"] + totals["disk"] == sum(p.numel() for p in model.parameters()) * 2


def test_a_wider_build_computes_its_buffers_as_the_checkpoints_dtype_does(
    tmp_path: Path, settings: Settings
) -> None:
    """A bfloat16 Gemma 3 built in float32 (as a verified job builds it) holds the buffers
    transformers' from_pretrained(dtype="auto") then a cast hold: embed_scale = sqrt(640) is
    25.25 in bfloat16, 25.298 computed in float32; rotary inv_freq stays transformers' float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=64, hidden_size=640, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "g")
    want = dict(
        torch.nn.Module.float(
            AutoModelForCausalLM.from_pretrained(tmp_path / "g", dtype="auto")
        ).named_buffers()
    )
    with open_checkpoint(tmp_path / "g") as checkpoint:
        wide = build_on_meta(checkpoint, settings, dtype=torch.float32)
        natural = build_on_meta(checkpoint, settings)
    got = dict(wide.model.named_buffers())
    assert got["model.embed_tokens.embed_scale"].item() == 25.25
    assert natural.model.get_buffer("model.embed_tokens.embed_scale").dtype == torch.bfloat16
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
