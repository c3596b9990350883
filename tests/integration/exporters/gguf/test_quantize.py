"""K-quants by llama.cpp's own llama-quantize (``service.exporters.gguf.quantize``): the exporter's
file IS llama-quantize's output on our verified f16 (byte for byte), carries its per-tensor
mixture, loads in llama.cpp, and a cancel or a failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from service.config import Settings
from service.errors import (
    ExportFailed,
    JobCancelled,
)
from service.exporters.gguf import GGUFSpec
from service.exporters.gguf.directory import read_directory
from service.exporters.gguf.quantize import compute_imatrix, quantize, sha256_of
from service.shims.llama_cpp import llama_cpp_tool
from service.stage import InMemoryContext
from tests.fixtures.gguf_files import export_gguf

CALIBRATION = (
    "the quick brown fox jumps over the lazy dog. llama.cpp reads gguf files written tensor by "
    "tensor; weights are streamed with bounded memory, 1234 5678. "
) * 60


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


def test_q4_k_m_is_llama_quantize_output_on_our_f16_byte_for_byte(
    wide_llama: Path, tmp_path: Path
) -> None:
    result, ctx = export_gguf(wide_llama, tmp_path / "q", "q4_k_m", verify=False)
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
    # llama-quantize maps the f16 file it reads, whose pages its RSS counts and its anonymous
    # peak (a tensor's input and output at a time) does not
    anon = result.summary["quantizer_peak_anon_bytes"]
    assert anon is not None and 0 < anon < result.summary["quantizer_peak_rss_bytes"], anon
    assert not (ctx.work_dir / "gguf" / "model-f16.gguf").exists(), "the f16 stage is removed"
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == [path.name]

    # Running llama-quantize by hand on our f16 export gives the very same bytes.
    f16, _ = export_gguf(wide_llama, tmp_path / "f", "f16", verify=False)
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
    result, _ = export_gguf(wide_llama, tmp_path / "out", type_, verify=False)
    main = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q5_K_S": "Q5_K", "Q6_K": "Q6_K"}.get(type_, type_)
    assert main in result.summary["tensor_types"], result.summary["tensor_types"]
    assert read_directory(tmp_path / "out" / f"model-{type_}.gguf").tensors


def test_imatrix_from_calibration_text_changes_the_quantization(
    wide_llama: Path, tmp_path: Path
) -> None:
    plain, _ = export_gguf(wide_llama, tmp_path / "plain", "IQ4_XS", verify=False)
    spec = GGUFSpec.model_validate(
        {
            "format": "gguf",
            "type": "iq4_xs",
            "imatrix": {"calibration": CALIBRATION},
            "verify": False,
            "pre_tokenizer_fallback": "default",
        }
    )
    weighted, _ = export_gguf(wide_llama, tmp_path / "weighted", spec)
    assert weighted.summary["imatrix"] is True
    assert weighted.digests["model-IQ4_XS.gguf"] != plain.digests["model-IQ4_XS.gguf"]

    # An importance matrix given as a source (a file:// URI inside the allowed roots) is the one
    # llama-quantize uses: the job's file is llama-quantize's by hand with that matrix, byte for
    # byte (llama-imatrix itself is not bit-reproducible from run to run).
    f16, _ = export_gguf(wide_llama, tmp_path / "f16", "f16", verify=False)
    f16_file = tmp_path / "f16" / f16.files[0]
    imatrix = compute_imatrix(f16_file, CALIBRATION, tmp_path / "f16", lambda: None)
    given = GGUFSpec.model_validate(
        {"format": "gguf", "type": "IQ4_XS", "verify": False, "pre_tokenizer_fallback": "default",
         "imatrix": {"uri": f"file://{imatrix}"}}
    )  # fmt: skip
    ctx = InMemoryContext(
        Settings(data_dir=tmp_path / "var", local_roots=[tmp_path]), tmp_path / "work"
    )
    from_file, _ = export_gguf(wide_llama, tmp_path / "given", given, ctx)
    assert from_file.summary["imatrix_source"]["sha256"] == sha256_of(imatrix)
    by_hand = tmp_path / "by-hand.gguf"
    quantize(with_recipe_of(tmp_path / "given" / "model-IQ4_XS.gguf", f16_file), by_hand,
             "IQ4_XS", tmp_path, lambda: None, lambda n: None, 1, imatrix=imatrix)  # fmt: skip
    assert from_file.digests["model-IQ4_XS.gguf"] == sha256_of(by_hand)
    assert from_file.digests["model-IQ4_XS.gguf"] != plain.digests["model-IQ4_XS.gguf"]


def test_cancel_kills_the_quantizer_and_leaves_no_file(wide_llama: Path, tmp_path: Path) -> None:
    f16, _ = export_gguf(wide_llama, tmp_path / "f", "f16", verify=False)
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
