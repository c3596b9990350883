"""The pinned llama.cpp tools are built and runnable: the GGUF exporter and the GGUF consumer
checks depend on them, so their absence fails the suite instead of skipping it."""

from __future__ import annotations

import subprocess

import pytest

from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION, TOOLS, default_bin_dir, llama_cpp_tool


@pytest.mark.parametrize("name", TOOLS)
def test_every_pinned_llama_cpp_tool_is_built_and_runs(name: str) -> None:
    path = llama_cpp_tool(name)
    done = subprocess.run(
        [str(path), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    # Each tool prints its usage; none may crash (a SIGILL would mean a CPU the build can't run on).
    assert done.returncode >= 0, f"{name} died with signal {-done.returncode}"
    assert "usage" in (done.stdout + done.stderr).lower(), done.stderr[-500:]


def test_the_cache_is_keyed_by_the_pinned_version() -> None:
    assert default_bin_dir().parent.name == LLAMA_CPP_PYTHON_VERSION
    assert (default_bin_dir().parent / "VERSION").read_text().strip() == LLAMA_CPP_PYTHON_VERSION
