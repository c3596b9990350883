"""int4/int8 ONNX (onnxruntime's MatMulNBits) in both layouts, on a tiny random Llama (untied
head) and on real SmolLM2 cut to two layers (tied head, and untied: its head stored apart), each
run here in onnxruntime and, for the genai layout, in onnxruntime-genai's generator. A tied int4
embedding is ``GatherBlockQuantized`` over the head's blocks, as the model builder writes it.

The exporter's own check (PyTorch on the weights dequantized from the artifact vs onnxruntime,
then onnxruntime-genai's greedy tokens) must pass; the tests then check from outside: a quantized
weight in the file is byte for byte onnxruntime's own quantizer's output on transformers' weight,
the graph holds MatMulNBits and no float copy of a linear weight, and a fresh onnxruntime /
onnxruntime-genai session decodes the tokens the check reported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import onnx
import onnxruntime_genai as og
import pytest
import torch
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    DefaultWeightOnlyQuantizer,
)
from transformers import AutoModelForCausalLM

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.exporters.base import ExportInputs
from service.exporters.onnx.artifact_weights import external_initializers
from service.exporters.onnx.exporter import DATA_NAME, MODEL_NAME, ONNXExporter, ONNXSpec
from service.exporters.onnx.genai import GENAI_CONFIG
from service.stage import InMemoryContext
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.real_models import Variant, real_variant
from tests.integration.exporters.test_onnx import _decode_in_ort

CASES = [
    ("llama", {"weights": "int4", "block_size": 128, "symmetric": False, "layout": "optimum"}),
    ("llama", {"weights": "int8", "block_size": 32, "symmetric": True, "layout": "genai"}),
    ("smollm2", {"weights": "int4", "block_size": 32, "symmetric": True, "layout": "genai"}),
    ("smollm2", {"weights": "int8", "block_size": 128, "symmetric": False, "layout": "optimum"}),
    ("smollm2", {"weights": "int4", "block_size": 128, "symmetric": False, "layout": "genai"}),
    ("smollm2-untied", {"weights": "int4", "block_size": 32, "symmetric": True, "layout": "genai"}),
]


def _source(name: str, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path) -> Path:
    if name == "llama":
        return tiny_checkpoint("llama", "safetensors")
    tied = real_variant("smollm2", Variant(layers=2))
    if name == "smollm2":
        return tied
    return _untied(tied, tmp_path / "untied")


def _untied(tied: Path, out: Path) -> Path:
    """``tied`` with its head stored apart (a copy of the embedding) and untied in its config:
    real weights, the layout of an untied model."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tied, out)
    state = load_file(out / "model.safetensors")
    names = ("model.embed_tokens.weight", "lm_head.weight")
    (stored,) = [state[n] for n in names if n in state]  # the tied weight, under either name
    state.update({n: stored.clone() for n in names})
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out


@pytest.mark.parametrize(
    "name,fields",
    CASES,
    ids=[f"{n}-{f['weights']}-b{f['block_size']}-{f['layout']}" for n, f in CASES],
)
def test_quantized_export_is_onnxruntimes_quantization_and_runs_in_its_layout(
    name: str, fields: dict[str, Any], tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    source = _source(name, tiny_checkpoint, tmp_path)
    spec = ONNXSpec(decode_steps=5, **fields)
    ctx = InMemoryContext(Settings(data_dir=tmp_path / "data"), tmp_path / "work")
    ctx.work_dir.mkdir()
    out = tmp_path / "out"
    with open_checkpoint(source) as ckpt:
        result = ONNXExporter().export(spec, ExportInputs(checkpoint=ckpt), out, ctx)
    summary, verify = result.summary, result.summary["verify"]
    nbits = spec.nbits()
    assert nbits is not None
    lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    layers = lm.config.num_hidden_layers
    assert summary["weights"]["quantized_matmuls"] == 7 * layers + 1  # q k v o gate up down, head
    assert verify["reference_weights"] == "dequantized from the artifact"
    largest = verify["largest_weight_error"]  # every weight held to the source's, rounding only
    assert largest["weights"] == 7 * layers + 1
    assert 0 < largest["relative_rms"] < (0.2 if nbits.bits == 4 else 0.02), largest
    assert verify["max_abs_err"] <= verify["tolerance"] and all(verify["argmax_agreed"])

    graph = onnx.load(str(out / MODEL_NAME), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 7 * layers + 1
    names = {i.name for i in graph.initializer}
    assert "model.layers.0.mlp.down_proj.weight" not in names  # no float copy left
    (lookup,) = [n for n in graph.node if n.op_type.startswith("Gather") and "input_ids" in n.input]
    floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    if lm.config.tie_word_embeddings and nbits.bits == 4:  # the head's blocks, as the builder
        assert lookup.op_type == "GatherBlockQuantized" and lookup.domain == "com.microsoft"
        (reshape,) = [n for n in graph.node if n.output[0] == lookup.input[0]]
        assert reshape.input[0] == "lm_head.weight_Q4"
        assert (
            lookup.input[2:]
            == ["lm_head.weight_scales", "lm_head.weight_zp"][: 2 - nbits.symmetric]
        )
        assert not floats & {"lm_head.weight", "model.embed_tokens.weight"}  # no float copy
        assert summary["weights"]["embedding"].startswith("com.microsoft.GatherBlockQuantized")
        assert summary["data_bytes"] < lm.model.embed_tokens.weight.numel() * 4
    else:  # the builder's float embedding: int8, or an untied head
        assert lookup.op_type == "Gather" and lookup.input[0] in floats
        assert summary["weights"]["embedding"] == "float"

    # One weight's blocks, read back from the data file, are onnxruntime's quantizer's bytes.
    weight = lm.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    config = DefaultWeightOnlyQuantConfig(
        block_size=nbits.block_size, is_symmetric=nbits.symmetric, bits=nbits.bits
    )
    packed, scales, zero = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight.T.copy())
    read = external_initializers(out / MODEL_NAME)
    prefix = "model.layers.1.self_attn.q_proj.weight"
    assert read(f"{prefix}_Q{nbits.bits}").tobytes() == packed.tobytes()
    assert read(f"{prefix}_scales").tobytes() == scales.tobytes()
    zp = read(f"{prefix}_zp")
    assert (zp is None) == nbits.symmetric
    if zp is not None:
        assert zp.tobytes() == zero.tobytes()

    # A fresh onnxruntime session decodes the check's tokens from the package.
    tokens = verify["tokens"]
    assert _decode_in_ort(out / MODEL_NAME, _prompt(spec, lm), len(tokens)) == tokens
    assert summary["layout"] == fields["layout"]
    if fields["layout"] == "optimum":
        assert not (out / GENAI_CONFIG).exists() and "genai" not in verify
        return
    # onnxruntime-genai loads the directory and generates the same tokens greedily.
    assert GENAI_CONFIG in result.files
    assert verify["genai"]["tokens"] == tokens[: len(verify["genai"]["tokens"])]
    model = og.Model(str(out))
    params = og.GeneratorParams(model)
    prompt_ids = _prompt(spec, lm)
    params.set_search_options(do_sample=False, max_length=len(prompt_ids) + len(tokens))
    generator = og.Generator(model, params)
    generator.append_tokens(prompt_ids)
    generated: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        generated.append(int(generator.get_next_tokens()[0]))
    assert generated == verify["genai"]["tokens"]
    config = json.loads((out / GENAI_CONFIG).read_text())
    assert config["model"]["decoder"]["num_key_value_heads"] == lm.config.num_key_value_heads
    assert (out / DATA_NAME).stat().st_size == summary["data_bytes"]


def _prompt(spec: ONNXSpec, lm: Any) -> list[int]:
    from service.verification.reference import prompt_ids

    return prompt_ids(spec.prompt_tokens, int(lm.config.vocab_size))


@pytest.mark.parametrize("name", ["falcon", "gpt_neox", "gemma2"])
def test_int4_of_other_families_passes_the_exact_check_and_runs_in_genai(
    name: str, tmp_path: Path
) -> None:
    """Families whose linear layers differ from Llama's: Falcon's ``FalconLinear`` and fused
    QKV, GPT-NeoX's biases, Gemma 2's eager attention; the first two are onnxruntime-genai's
    generic ``decoder`` type."""
    from service.exporters.onnx.genai import genai_model_type
    from tests.fixtures.families import family_checkpoint

    source = family_checkpoint(name)
    spec = ONNXSpec(decode_steps=3, weights="int4")
    ctx = InMemoryContext(Settings(data_dir=tmp_path / "data"), tmp_path / "work")
    ctx.work_dir.mkdir()
    with open_checkpoint(source) as ckpt:
        result = ONNXExporter().export(spec, ExportInputs(checkpoint=ckpt), tmp_path / "out", ctx)
    verify = result.summary["verify"]
    assert verify["reference_weights"] == "dequantized from the artifact"
    assert verify["max_abs_err"] <= verify["tolerance"] and all(verify["argmax_agreed"])
    assert verify["genai"]["agreed_steps"] == verify["genai"]["steps"] == 4
    graph = onnx.load(str(tmp_path / "out" / MODEL_NAME), load_external_data=False).graph
    linears = sum(isinstance(m, torch.nn.Linear) for m in _meta_lm(source).modules())
    assert [n.op_type for n in graph.node].count("MatMulNBits") == linears
    config = json.loads((tmp_path / "out" / GENAI_CONFIG).read_text())
    assert config["model"]["type"] == genai_model_type(name)


def _meta_lm(source: Path) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))


def test_the_exact_check_reads_a_gathered_embedding_from_the_artifact(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """The tied int4 embedding is checked on the artifact's blocks: the same check with PyTorch
    reading the float embedding instead (the rows it would miss) leaves the tolerance."""
    from service.errors import VerificationFailed
    from service.exporters.common.offloaded_model import offloaded_model
    from service.exporters.onnx.quantize import NBits, QuantizedWeights
    from service.exporters.onnx.verify import verify_causal_lm
    from service.offload.build import build_on_meta

    source = tiny_checkpoint("llama", "safetensors", tied=True)
    spec = ONNXSpec(decode_steps=2, weights="int4", block_size=16)
    ctx = InMemoryContext(Settings(data_dir=tmp_path / "data"), tmp_path / "work")
    ctx.work_dir.mkdir()
    out = tmp_path / "out"
    with open_checkpoint(source) as ckpt:
        result = ONNXExporter().export(spec, ExportInputs(checkpoint=ckpt), out, ctx)
        assert result.summary["verify"]["max_abs_err"] <= result.summary["verify"]["tolerance"]
        graph = onnx.load(str(out / MODEL_NAME), load_external_data=False).graph
        matmuls = tuple(n.input[1].removesuffix("_Q4") for n in graph.node
                        if n.op_type == "MatMulNBits")  # fmt: skip
        assert "lm_head.weight" in matmuls
        built = offloaded_model(build_on_meta(ckpt, Settings()).model, ckpt, offload_dir=tmp_path)
        args = (out / MODEL_NAME, built.module, 4, 2, 1e-3, 1e-3)
        exact = QuantizedWeights(NBits(4, 16, True), matmuls, ("lm_head.weight",))
        report = verify_causal_lm(*args, work=tmp_path / "v1", quantized=exact)
        assert report.max_abs_err <= report.tolerance
        float_rows = QuantizedWeights(NBits(4, 16, True), matmuls)
        with pytest.raises(VerificationFailed, match="logits differ"):
            verify_causal_lm(*args, work=tmp_path / "v2", quantized=float_rows)
