"""Quantized checkpoints: FP8 read as transformers reads it, every other method refused by name,
a config the tensors contradict ignored (and said so)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from service.api.errors import http_status
from service.checkpoint import open_checkpoint
from service.checkpoint.base import ReadsInto
from service.checkpoint.quantization import plan_quantization
from service.errors import UnsupportedQuantization
from tests.fixtures.quantized import (
    AWQ_CONFIG,
    BNB_CONFIG,
    GPTQ_CONFIG,
    bnb4_tensors,
    fp8_dequantize,
    gptq_tensors,
    with_quantization_config,
    write_fp8,
)


def test_fp8_weights_read_bit_for_bit_as_transformers_dequantizes_them(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    ckpt_dir = write_fp8(llama_safetensors_dir, tmp_path / "fp8", block=(32, 32))
    stored = load_file(str(ckpt_dir / "model.safetensors"))
    with open_checkpoint(ckpt_dir) as ckpt:
        infos = {i.name: i for i in ckpt.reader.tensor_infos()}
        assert not [n for n in infos if n.endswith("_scale_inv")]
        fp8 = [n for n in stored if stored[n].dtype == torch.float8_e4m3fn]
        assert fp8 and all(infos[n].dtype == torch.float32 for n in fp8)  # the config's dtype
        for name in fp8:
            expected = Fp8Dequantize(None)._dequantize_one(
                stored[name], stored[name + "_scale_inv"], output_dtype=torch.float32
            )
            assert torch.equal(ckpt.reader.read(name), expected), name
            assert ckpt.reader.region(name) is None  # its bytes on disk are codes, not weights
        assert "quantization_config" not in (ckpt.config or {})
        assert ckpt.quantization is not None
        assert ckpt.quantization["method"] == "fp8"
        assert ckpt.quantization["handling"] == "dequantize"
        assert ckpt.quantization["dequantized_tensors"] == len(fp8)


def test_fp8_partial_edge_blocks_read_as_deepseek_dequantizes_them(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    """DeepSeek-V3's grids end in partial blocks (576 rows in 128-row blocks); here 64 and 128
    wide weights in 48x48 blocks, read whole, in chunks and by ``read_into`` at odd offsets."""
    block = (48, 48)
    ckpt_dir = write_fp8(llama_safetensors_dir, tmp_path / "fp8", block=block)
    stored = load_file(str(ckpt_dir / "model.safetensors"))
    with open_checkpoint(ckpt_dir) as ckpt:
        reader = ckpt.reader
        assert isinstance(reader, ReadsInto)
        for name, codes in stored.items():
            if codes.dtype != torch.float8_e4m3fn:
                continue
            expected = fp8_dequantize(codes, stored[name + "_scale_inv"], block)
            assert torch.equal(reader.read(name), expected), name
            chunks = torch.cat(list(reader.iter_chunks(name, 7 * expected.shape[1] * 4 + 3)))
            assert torch.equal(chunks, expected.reshape(-1)), name
            out = torch.empty(101, dtype=torch.float32)
            reader.read_into(name, 1000, out)
            assert torch.equal(out, expected.reshape(-1)[1000:1101]), name


def test_fp8_checkpoint_exports_no_scale_and_no_quantization_config(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    """The config the exporters carry over says float: read with it, the artifact is float."""
    ckpt_dir = write_fp8(llama_safetensors_dir, tmp_path / "fp8", block=(32, 32))
    original = json.loads((ckpt_dir / "config.json").read_text())
    assert original["quantization_config"]["quant_method"] == "fp8"
    with open_checkpoint(ckpt_dir) as ckpt:
        assert ckpt.config == {k: v for k, v in original.items() if k != "quantization_config"}


def _refusal(config_dir: Path) -> UnsupportedQuantization:
    with pytest.raises(UnsupportedQuantization) as refused:
        open_checkpoint(config_dir)
    assert http_status(refused.value) == 422
    return refused.value


@pytest.mark.parametrize(
    ("config", "tensors", "method"),
    [
        (GPTQ_CONFIG, gptq_tensors(), "gptq"),
        (AWQ_CONFIG, gptq_tensors(), "awq"),
        (BNB_CONFIG, bnb4_tensors(), "bitsandbytes"),
        ({"load_in_8bit": True}, {"model.layers.0.mlp.up_proj.SCB": torch.ones(128)}, "bitsandbytes"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {}},
            {"model.layers.0.mlp.up_proj.weight_packed": torch.zeros(128, 8, dtype=torch.int32)},
            "compressed-tensors",
        ),
    ],
    ids=["gptq", "awq", "bitsandbytes-4bit", "bitsandbytes-8bit-legacy", "compressed-tensors"],
)
def test_quantized_methods_the_readers_do_not_implement_are_refused_by_name(
    llama_safetensors_dir: Path, tmp_path: Path, config: dict[str, object],
    tensors: dict[str, torch.Tensor], method: str,
) -> None:  # fmt: skip
    ckpt_dir = with_quantization_config(llama_safetensors_dir, tmp_path / method, config, tensors)
    refused = _refusal(ckpt_dir)
    assert refused.method == method
    assert repr(method) in refused.message and "fp8" in refused.message


def test_float8_without_its_scales_is_refused(llama_safetensors_dir: Path, tmp_path: Path) -> None:
    ckpt_dir = write_fp8(llama_safetensors_dir, tmp_path / "fp8", block=(32, 32))
    state = load_file(str(ckpt_dir / "model.safetensors"))
    dropped = {n: t for n, t in state.items() if not n.endswith("_scale_inv")}
    from safetensors.torch import save_file

    save_file(dropped, str(ckpt_dir / "model.safetensors"), metadata={"format": "pt"})
    assert "without its scales" in _refusal(ckpt_dir).message
    config = json.loads((ckpt_dir / "config.json").read_text())
    del config["quantization_config"]
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    refused = _refusal(ckpt_dir)  # no config at all: the dtype alone says it is quantized
    assert refused.method is None and "float8" in refused.message


def test_fp8_with_a_scale_grid_of_the_wrong_shape_is_refused() -> None:
    tensors = {
        "model.layers.0.mlp.up_proj.weight": ("F8_E4M3", [128, 64]),
        "model.layers.0.mlp.up_proj.weight_scale_inv": ("F32", [1, 1]),
    }
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
    with pytest.raises(UnsupportedQuantization, match=r"needs \[2, 1\]"):
        plan_quantization(config, tensors)
    no_block = {"quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(UnsupportedQuantization, match="weight_block_size"):
        plan_quantization(no_block, tensors)


def test_a_quantization_config_the_float_tensors_contradict_is_ignored_and_recorded(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    """transformers' save of a dequantized GGUF keeps ``{"quant_method": "gguf"}``."""
    ckpt_dir = with_quantization_config(llama_safetensors_dir, tmp_path / "g", {"quant_method": "gguf"})
    with open_checkpoint(ckpt_dir) as ckpt:
        assert "quantization_config" not in (ckpt.config or {})
        assert ckpt.quantization is not None
        assert ckpt.quantization["method"] == "gguf"
        assert ckpt.quantization["handling"] == "ignored"
        assert "contradict" in ckpt.quantization["reason"]
        names = {i.name for i in ckpt.reader.tensor_infos()}
    with open_checkpoint(llama_safetensors_dir) as plain:
        assert ckpt.quantization is not None and plain.quantization is None
        assert names == {i.name for i in plain.reader.tensor_infos()}

