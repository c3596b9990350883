"""Where the pinned llama.cpp tools live, so the GGUF exporter and its tests run the real thing.

llama.cpp is not a Python package: ``scripts/build_llama_cpp.sh`` (run by ``make install``, CI
and the image build) compiles the tools of the llama.cpp that the PyPI sdist
``llama-cpp-python==LLAMA_CPP_PYTHON_VERSION`` vendors, once per machine, into
``<cache>/llama.cpp/<version>/bin``. This module only finds them; a missing tool is a typed
:class:`~service.errors.ToolMissing` that says how to build it, never a bare ``FileNotFoundError``
deep inside a job.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.errors import ToolMissing

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The sdist whose vendored llama.cpp is built; its gguf-py is the venv's ``gguf``
(``scripts/install_gguf_py.sh``)."""

TOOLS = (
    "llama-quantize",
    "llama-imatrix",
    "llama-perplexity",
    "llama-tokenize",
    "llama-simple",
    "llama-completion",
    "llama-embedding",
    "llama-gguf-split",
    "llama-mtmd-cli",
)


TOOL_ENV: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "LLAMA_ARG_REPACK": "0"}
"""Environment of every llama.cpp tool the service runs.

``LLAMA_ARG_REPACK=0`` (``--no-repack`` of every tool that takes llama.cpp's common arguments):
on x86 with AVX2 the CPU backend copies each Q4_0/Q4_K/IQ4_NL weight into an interleaved layout
in anonymous memory at load, so the check of a K-quant file held a second copy of most of it,
and that copy grows with the model: the Q4_K_M check's llama-perplexity held 1.11 GiB of
anonymous memory at 10.52 GB in bench/memory_budget.py, where q8_0's (not repacked) held 0.10.
Measured on a hidden-4096 Q4_K_M of 2 layers (500 MB): a 184 MiB ``CPU_REPACK`` buffer and
960 MB peak RSS with it, none and 800 MB without; on the fixed text's few chunks the repacking
costs about what it saves (4.6 s and 4.4 s). Without it the tools read the mapped file, which
the kernel can reclaim, and hold only their KV cache and compute buffers.

``OMP_WAIT_POLICY=PASSIVE``: its OpenMP threads sleep at a barrier
instead of spinning. The tools are built with OpenMP and synchronise their threads at every
operation of the graph; on a machine busy with other work (a 2-core host shared by jobs and
tests), a thread spinning at the barrier takes the core its partner needs to get there.
Measured on a loaded 2-core host (load average 11), llama-perplexity of a 1.8 GB f16 GGUF on
the fixed text with 2 threads: 67 s wall (16.9 s CPU) spinning, 35 s (8.8 s CPU) passive; the
same perplexity either way (the schedule changes, not the arithmetic)."""


def cache_home() -> Path:
    """The per-machine cache of built tools and test fixtures (``MODELPREP_CACHE_HOME``)."""
    explicit = os.environ.get("MODELPREP_CACHE_HOME")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "modelprep"


def default_bin_dir() -> Path:
    """Where ``scripts/build_llama_cpp.sh`` puts the binaries of the pinned version."""
    return cache_home() / "llama.cpp" / LLAMA_CPP_PYTHON_VERSION / "bin"


def llama_cpp_tool(name: str, bin_dir: Path | None = None) -> Path:
    """The path of one llama.cpp tool (``llama-quantize``...), or :class:`ToolMissing`.

    ``bin_dir`` is ``Settings.llama_cpp_dir`` when the operator installed the tools elsewhere
    (the container image does); None means the build script's cache."""
    if name not in TOOLS:
        raise ValueError(f"{name} is not one of the llama.cpp tools modelprep builds: {TOOLS}")
    path = (bin_dir or default_bin_dir()) / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ToolMissing(
            f"llama.cpp tool {name} not found at {path}; build the pinned llama.cpp with "
            "`make llama-cpp` (scripts/build_llama_cpp.sh) or set MODELPREP_LLAMA_CPP_DIR"
        )
    return path
