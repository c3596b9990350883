"""llama-quantize's driver (``service.exporters.gguf.quantize``) when the tool is not there."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import ToolMissing
from service.exporters.gguf.quantize import quantize


def test_a_missing_quantizer_is_tool_missing(tmp_path: Path) -> None:
    bad = tmp_path / "in.gguf"
    bad.write_bytes(b"")
    with pytest.raises(ToolMissing):
        quantize(bad, tmp_path / "q.gguf", "Q6_K", tmp_path, lambda: None, lambda n: None, 1,
                 bin_dir=tmp_path)  # fmt: skip
