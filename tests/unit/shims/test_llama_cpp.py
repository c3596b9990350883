"""Finding the llama.cpp tools without them built: a missing one is a typed error that says how
to build it (that the pinned tools are built and run is tests/integration/test_llama_cpp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import ToolMissing
from service.shims.llama_cpp import llama_cpp_tool


def test_a_missing_tool_is_a_typed_error_that_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(ToolMissing, match="make llama-cpp"):
        llama_cpp_tool("llama-quantize", tmp_path)
