"""The exact check reads a GGUF's tensors from its directory and one map of the file
(``artifact_weights.stored_tensors``), not through ``gguf.GGUFReader``, whose parse of the
vocabulary cost 8.4 s of a 12 s check at SmolLM2's 49152 tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from service.exporters.gguf.artifact_weights import stored_tensors
from tests.fixtures.gguf_files import export_gguf


@pytest.mark.parametrize("type_", ["q8_0", "Q4_K_M"])
def test_stored_tensors_are_what_gguf_reader_reads(
    type_: str, llama: tuple[Path, Any], wide_llama: Path, tmp_path: Path
) -> None:
    """q8_0 of a Llama whose 80-wide rows fall back to f16 (F32 norms, F16, Q8_0); Q4_K_M of
    one 256 wide (Q4_K, Q6_K, F32)."""
    source = llama[0] if type_ == "q8_0" else wide_llama
    # unverified: this reads the file back; the tiny BPE's K-quant checks are test_quantize's
    result, _ = export_gguf(source, tmp_path / "out", type_, verify=False)
    path = tmp_path / "out" / result.files[0]
    mapped = list(stored_tensors(path))
    read = gguf.GGUFReader(path).tensors
    assert [t.name for t, _ in mapped] == [t.name for t in read]
    kinds = set()
    for (ours, data), theirs in zip(mapped, read, strict=True):
        kinds.add(ours.ggml_type)
        assert ours.ggml_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape)), ours.name
        assert data.dtype == theirs.data.dtype, ours.name
        assert data.shape == theirs.data.shape, ours.name
        assert np.array_equal(data, theirs.data), ours.name
    assert len(kinds) >= 3, kinds
