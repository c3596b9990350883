"""K-quants by llama.cpp's own llama-quantize: the exporter's file IS llama-quantize's output on
our verified f16 (byte for byte), carries its per-tensor mixture, loads in llama.cpp, and a
cancel or a failure leaves nothing behind.

The model is a tiny Llama whose rows are multiples of 256 so that the K-quant types apply
(narrower rows make llama-quantize fall back to legacy types, which would test nothing).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import ExportFailed, JobCancelled, ToolMissing, VerificationFailed
from service.exporters.base import ExportInputs, ExportResult
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.exporters.gguf.directory import read_directory
from service.exporters.gguf.llama_check import PPL_RATIO_BOUND, PROBES, _estimate, check_perplexity
from service.exporters.gguf.quantize import QUANTIZER_TYPES, compute_imatrix, quantize, sha256_of
from service.llama_cpp import llama_cpp_tool
from service.stage import InMemoryContext
from tests.unit.exporters.test_gguf import CORPUS, _randomize, _write_bpe_tokenizer

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


def with_recipe_of(job_file: Path, f16: Path) -> Path:
    """``f16`` rewritten by gguf-py's own gguf_new_metadata with ``job_file``'s
    ``general.description``: a job's files carry their own recipe there (the quantized file says
    Q4_K_M where our f16 export says f16), and llama-quantize copies the key from its input. So
    "by hand" is llama-quantize on our f16 holding the same recipe line; every other byte is
    compared as it is."""
    field = GGUFReader(job_file).get_field("general.description")
    assert field is not None, "the job's file carries its recipe"
    description = field.contents()
    assert isinstance(description, str) and "modelprep recipe" in description
    out = f16.with_name(f16.stem + "-recipe.gguf")
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(f16), str(out),
         "--general-description", description, "--force"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
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
    result, ctx = _export(wide_llama, tmp_path / "q", GGUFSpec(type="q4_k_m", verify=False, pre_tokenizer_fallback="default"))
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
    f16, _ = _export(wide_llama, tmp_path / "f", GGUFSpec(type="f16", verify=False, pre_tokenizer_fallback="default"))
    by_hand = tmp_path / "by-hand.gguf"
    subprocess.run(
        [str(llama_cpp_tool("llama-quantize")), str(with_recipe_of(path, tmp_path / "f" / f16.files[0])),
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
    result, _ = _export(wide_llama, tmp_path / "out", GGUFSpec(type=type_, verify=False, pre_tokenizer_fallback="default"))  # type: ignore[arg-type]
    main = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q5_K_S": "Q5_K", "Q6_K": "Q6_K"}.get(type_, type_)
    assert main in result.summary["tensor_types"], result.summary["tensor_types"]
    assert read_directory(tmp_path / "out" / f"model-{type_}.gguf").tensors


def test_imatrix_from_calibration_text_changes_the_quantization(
    wide_llama: Path, tmp_path: Path
) -> None:
    plain, _ = _export(wide_llama, tmp_path / "plain", GGUFSpec(type="IQ4_XS", verify=False, pre_tokenizer_fallback="default"))
    spec = GGUFSpec.model_validate(
        {
            "format": "gguf",
            "type": "iq4_xs",
            "imatrix": {"calibration": CALIBRATION},
            "verify": False,
            "pre_tokenizer_fallback": "default",
        }
    )
    weighted, _ = _export(wide_llama, tmp_path / "weighted", spec)
    assert weighted.summary["imatrix"] is True
    assert weighted.digests["model-IQ4_XS.gguf"] != plain.digests["model-IQ4_XS.gguf"]

    # An importance matrix given as a source (a file:// URI inside the allowed roots) is the one
    # llama-quantize uses: the job's file is llama-quantize's by hand with that matrix, byte for
    # byte (llama-imatrix itself is not bit-reproducible from run to run).
    f16, _ = _export(wide_llama, tmp_path / "f16", GGUFSpec(type="f16", verify=False,
                     pre_tokenizer_fallback="default"))  # fmt: skip
    f16_file = tmp_path / "f16" / f16.files[0]
    imatrix = compute_imatrix(f16_file, CALIBRATION, tmp_path / "f16", lambda: None)
    given = GGUFSpec.model_validate(
        {"format": "gguf", "type": "IQ4_XS", "verify": False, "pre_tokenizer_fallback": "default",
         "imatrix": {"uri": f"file://{imatrix}"}}
    )  # fmt: skip
    ctx = InMemoryContext(
        Settings(data_dir=tmp_path / "var", local_roots=[tmp_path]), tmp_path / "work"
    )
    from_file, _ = _export(wide_llama, tmp_path / "given", given, ctx)
    assert from_file.summary["imatrix_source"]["sha256"] == sha256_of(imatrix)
    by_hand = tmp_path / "by-hand.gguf"
    quantize(with_recipe_of(tmp_path / "given" / "model-IQ4_XS.gguf", f16_file), by_hand,
             "IQ4_XS", tmp_path, lambda: None, lambda n: None, 1, imatrix=imatrix)  # fmt: skip
    assert from_file.digests["model-IQ4_XS.gguf"] == sha256_of(by_hand)
    assert from_file.digests["model-IQ4_XS.gguf"] != plain.digests["model-IQ4_XS.gguf"]


def test_cancel_kills_the_quantizer_and_leaves_no_file(wide_llama: Path, tmp_path: Path) -> None:
    f16, _ = _export(wide_llama, tmp_path / "f", GGUFSpec(type="f16", verify=False, pre_tokenizer_fallback="default"))
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


# --- checked by llama.cpp in the job ----------------------------------------------------------


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wide Llama with a real SentencePiece byte-fallback tokenizer, which llama.cpp
    tokenizes exactly as transformers does."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    root = tmp_path_factory.mktemp("gguf-spm-llama")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(root / "tok"), vocab_size=340,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    ckpt = root / "ckpt"
    config = LlamaConfig(
        vocab_size=340, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _randomize(model, 0)
    model.save_pretrained(str(ckpt))
    LlamaTokenizer.from_pretrained(str(root), vocab_file=str(root / "tok.model")).save_pretrained(
        str(ckpt)
    )
    # The spm model too, so the GGUF gets its real scores (the tokenizer.json path writes
    # placeholders, with which llama.cpp's SentencePiece merges differently).
    shutil.copy(root / "tok.model", ckpt / "tokenizer.model")
    return ckpt


def test_quantized_file_is_tokenized_and_scored_by_llama_cpp(
    spm_llama: Path, tmp_path: Path
) -> None:
    result, _ = _export(spm_llama, tmp_path / "out", GGUFSpec(type="Q4_K_M"))
    checks = result.summary["llama_cpp"]
    assert checks["tokenizer"] == {"probes": len(PROBES), "tokens": checks["tokenizer"]["tokens"],
                                   "match": True}  # fmt: skip
    assert checks["tokenizer"]["tokens"] > len(PROBES)
    ppl = checks["perplexity"]
    assert ppl["f16"] > 1 and ppl["quantized"] > 1
    assert ppl["ratio"] == pytest.approx(ppl["quantized"] / ppl["f16"])
    assert ppl["ratio"] <= PPL_RATIO_BOUND["Q4_K_M"]
    assert ppl["quantized"] != ppl["f16"], "two files, two runs of llama-perplexity"


def test_a_tokenizer_llama_cpp_reads_differently_fails_the_job_and_leaves_no_file(
    wide_llama: Path, tmp_path: Path
) -> None:
    """The tiny byte-level BPE has a pre-tokenizer hash llama.cpp does not know; the job accepts
    the fallback, so the file says ``pre="default"``, which splits digits and punctuation unlike
    the checkpoint's tokenizer: llama.cpp's own check in the job catches it."""
    with pytest.raises(VerificationFailed, match="llama.cpp tokenizes"):
        _export(wide_llama, tmp_path / "out", GGUFSpec(type="Q6_K", pre_tokenizer_fallback="default"))
    assert list((tmp_path / "out").iterdir()) == []


def test_perplexity_beyond_the_type_bound_is_a_verification_failure() -> None:
    assert check_perplexity("Q6_K", 10.4, 10.0)["ratio"] == pytest.approx(1.04)
    with pytest.raises(VerificationFailed, match=r"Q6_K perplexity 10.600 is 1.06x"):
        check_perplexity("Q6_K", 10.6, 10.0)
    assert set(PPL_RATIO_BOUND) == set(QUANTIZER_TYPES.values())


def test_the_final_estimate_is_read_even_when_llama_cpp_loses_its_last_log_line() -> None:
    """The pinned llama.cpp leaks its logger at exit, so its last queued lines can be lost."""
    head = "perplexity: calculating perplexity over 3 chunks, n_ctx=128, batch_size=128\n"
    full = head + "[1]9.5,[2]9.1,[3]8.9,\nFinal estimate: PPL = 8.9000 +/- 0.3\n"
    assert _estimate(full) == "8.9000"
    assert _estimate(head + "[1]9.5,[2]9.1,[3]8.9,\n") == "8.9"
    assert _estimate(head + "[1]9.5,[2]9.1,") is None
