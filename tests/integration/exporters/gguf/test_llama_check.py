"""llama.cpp's own checks in the job (``service.exporters.gguf.llama_check``): it tokenizes the
probes as transformers does and scores the quantized file's perplexity within the type's bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import VerificationFailed
from service.exporters.gguf import GGUFSpec
from service.exporters.gguf.llama_check import (
    PPL_RATIO_BOUND,
    PROBES,
)
from tests.fixtures.gguf_files import export_gguf


def test_quantized_file_is_tokenized_and_scored_by_llama_cpp(
    spm_llama: Path, tmp_path: Path
) -> None:
    result, _ = export_gguf(spm_llama, tmp_path / "out", GGUFSpec(type="Q4_K_M"))
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
        export_gguf(wide_llama, tmp_path / "out", "Q6_K")
    assert list((tmp_path / "out").iterdir()) == []
