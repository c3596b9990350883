"""K-quants by llama.cpp's own llama-quantize: the exporter's file IS llama-quantize's output on
our verified f16 (byte for byte), carries its per-tensor mixture, loads in llama.cpp, and a
cancel or a failure leaves nothing behind.

The model is a tiny Llama whose rows are multiples of 256 so that the K-quant types apply
(narrower rows make llama-quantize fall back to legacy types, which would test nothing).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import ExportFailed, JobCancelled, ToolMissing
from service.exporters.base import ExportInputs, ExportResult
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.exporters.gguf_directory import read_directory
from service.exporters.gguf_quantize import QUANTIZER_TYPES, quantize
from service.llama_cpp import llama_cpp_tool
from service.stage import InMemoryContext
from tests.unit.exporters.test_gguf import _randomize, _write_bpe_tokenizer

CALIBRATION = (
    "the quick brown fox jumps over the lazy dog. llama.cpp reads gguf files written tensor by "
    "tensor; weights are streamed with bounded memory, 1234 5678. "
) * 60


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-wide-llama")
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _randomize(model, 0)
    model.save_pretrained(str(out))
    _write_bpe_tokenizer(out)
    return out


def _ctx(tmp_path: Path) -> InMemoryContext:
    return InMemoryContext(Settings(data_dir=tmp_path / "var"), tmp_path / "work")


def _export(
    ckpt: Path, out: Path, spec: GGUFSpec, ctx: InMemoryContext | None = None
) -> tuple[ExportResult, InMemoryContext]:
    out.mkdir(parents=True, exist_ok=True)
    ctx = ctx or _ctx(out.parent)
    with open_checkpoint(ckpt) as checkpoint:
        result = GGUFExporter().export(spec, ExportInputs(checkpoint), out, ctx)
    return result, ctx


def test_q4_k_m_is_llama_quantize_output_on_our_f16_byte_for_byte(
    wide_llama: Path, tmp_path: Path
) -> None:
    result, ctx = _export(wide_llama, tmp_path / "q", GGUFSpec(type="q4_k_m"))
    path = tmp_path / "q" / "model-Q4_K_M.gguf"
    assert result.files == ["model-Q4_K_M.gguf"]
    assert result.digests[path.name] == hashlib.sha256(path.read_bytes()).hexdigest()
    # The mixture is llama-quantize's: Q4_K for most weights, Q6_K for the output and half of
    # attn_v/ffn_down, f32 norms.
    types = result.summary["tensor_types"]
    assert {"Q4_K", "Q6_K", "F32"} <= set(types), types
    assert result.summary["quantizer"] == "llama-quantize"
    assert ctx.done == ctx.total, "progress reaches its total"
    assert ctx.metrics["quantizer_peak_rss_bytes"] > 0
    assert not (ctx.work_dir / "gguf" / "model-f16.gguf").exists(), "the f16 stage is removed"
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == [path.name]

    # Running llama-quantize by hand on our f16 export gives the very same bytes.
    f16, _ = _export(wide_llama, tmp_path / "f", GGUFSpec(type="f16"))
    by_hand = tmp_path / "by-hand.gguf"
    subprocess.run(
        [str(llama_cpp_tool("llama-quantize")), str(tmp_path / "f" / f16.files[0]),
         str(by_hand), "Q4_K_M", "1"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert by_hand.read_bytes() == path.read_bytes()

    # llama.cpp loads it and generates.
    done = subprocess.run(
        [str(llama_cpp_tool("llama-simple")), "-m", str(path), "-n", "4", "the quick"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.startswith(b"the quick") and len(done.stdout) > len(b"the quick")


@pytest.mark.parametrize("type_", ["Q2_K", "Q3_K_S", "Q5_K_S", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_each_quantizer_type_writes_its_own_tensor_type(
    wide_llama: Path, tmp_path: Path, type_: str
) -> None:
    result, _ = _export(wide_llama, tmp_path / "out", GGUFSpec(type=type_))  # type: ignore[arg-type]
    main = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q5_K_S": "Q5_K", "Q6_K": "Q6_K"}.get(type_, type_)
    assert main in result.summary["tensor_types"], result.summary["tensor_types"]
    assert read_directory(tmp_path / "out" / f"model-{type_}.gguf").tensors


def test_imatrix_from_calibration_text_changes_the_quantization(
    wide_llama: Path, tmp_path: Path
) -> None:
    plain, _ = _export(wide_llama, tmp_path / "plain", GGUFSpec(type="IQ4_XS"))
    spec = GGUFSpec.model_validate(
        {"format": "gguf", "type": "iq4_xs", "imatrix": {"calibration": CALIBRATION}}
    )
    weighted, _ = _export(wide_llama, tmp_path / "weighted", spec)
    assert weighted.summary["imatrix"] is True
    assert weighted.digests["model-IQ4_XS.gguf"] != plain.digests["model-IQ4_XS.gguf"]


def test_cancel_kills_the_quantizer_and_leaves_no_file(wide_llama: Path, tmp_path: Path) -> None:
    f16, _ = _export(wide_llama, tmp_path / "f", GGUFSpec(type="f16"))
    dest = tmp_path / "q.gguf"

    def cancelled() -> None:
        raise JobCancelled("cancelled")

    with pytest.raises(JobCancelled):
        quantize(tmp_path / "f" / f16.files[0], dest, "Q4_K_M", tmp_path, cancelled,
                 lambda n: None, 1)  # fmt: skip
    assert not dest.exists()


def test_a_quantizer_failure_is_typed_and_leaves_no_file(tmp_path: Path) -> None:
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    dest = tmp_path / "q.gguf"
    with pytest.raises(ExportFailed, match="llama-quantize exited"):
        quantize(bad, dest, "q4_k_m", tmp_path, lambda: None, lambda n: None, 1)
    assert not dest.exists()


def test_a_missing_quantizer_is_tool_missing(tmp_path: Path) -> None:
    bad = tmp_path / "in.gguf"
    bad.write_bytes(b"")
    with pytest.raises(ToolMissing):
        quantize(bad, tmp_path / "q.gguf", "Q6_K", tmp_path, lambda: None, lambda n: None, 1,
                 bin_dir=tmp_path)  # fmt: skip


def test_type_is_case_insensitive_and_imatrix_needs_a_quantizer_type() -> None:
    assert GGUFSpec.model_validate({"format": "gguf", "type": "q4_k_m"}).type == "Q4_K_M"
    assert GGUFSpec.model_validate({"format": "gguf", "type": "Iq4_Xs"}).type == "IQ4_XS"
    assert GGUFSpec.model_validate({"format": "gguf", "type": "F16"}).type == "f16"
    assert GGUFSpec.model_validate({"format": "gguf", "type": "Q8_0"}).type == "q8_0"
    assert {GGUFSpec(type=t).type for t in QUANTIZER_TYPES.values()} == set(  # type: ignore[arg-type]
        QUANTIZER_TYPES.values()
    )
    with pytest.raises(ValidationError, match="importance matrix"):
        GGUFSpec.model_validate(
            {"format": "gguf", "type": "q8_0", "imatrix": {"calibration": "some text"}}
        )
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"format": "gguf", "type": "Q4_K_X"})
