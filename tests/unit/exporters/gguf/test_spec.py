"""The GGUF export's spec (``service.exporters.gguf.spec``): the types llama.cpp writes, the
importance matrix's two forms, split sizes, and a package import the API process can afford.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.exporters.gguf import GGUFSpec
from service.exporters.gguf.quantize import QUANTIZER_TYPES


def test_spec_accepts_only_llama_cpp_types() -> None:
    assert GGUFSpec.model_validate({"format": "gguf", "type": "q4_0"}).type == "q4_0"
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"format": "gguf", "type": "q4_k"})
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"format": "gguf", "type": "f16", "bits": 4})


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


def test_imatrix_is_calibration_text_or_a_uri_exactly_one() -> None:
    base = {"format": "gguf", "type": "Q4_K_M"}
    for imatrix in ({}, {"calibration": "text", "uri": "file:///x.gguf"}, {"sha256": "0" * 64}):
        with pytest.raises(ValidationError):
            GGUFSpec.model_validate({**base, "imatrix": imatrix})
    spec = GGUFSpec.model_validate({**base, "imatrix": {"uri": "https://h.example/imatrix.gguf"}})
    assert spec.imatrix is not None and spec.runs_llama_cpp  # verify still runs llama.cpp
    unverified = spec.model_copy(update={"verify": False})
    assert not unverified.runs_llama_cpp  # a given imatrix needs no tokenizer


@pytest.mark.parametrize("size", ["0", "-1GB", "ten", 0])
def test_an_unparseable_max_shard_size_is_refused_at_submission(size: object) -> None:
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"type": "f16", "max_shard_size": size})


def test_importing_the_exporter_does_not_load_gguf_or_tokenizers() -> None:
    """The API process imports exporter specs for validation; the heavy stack stays out."""

    code = (
        "import sys; import service.exporters.gguf as g; g.GGUFSpec(type='q8_0'); "
        "print(sorted(m for m in ('gguf', 'sentencepiece', 'tokenizers', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[4],
    )
    assert out.stdout.strip() == "[]"
