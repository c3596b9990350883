"""Wall time and peak RSS of one command, measured without the caller's own memory.

Why not ``ru_maxrss`` of a child straight from ``wait4``: Linux records the pre-``exec`` image's
high-water mark into the process's ``maxrss`` at ``exec`` (``setmax_mm_hiwater_rss``), and a
child started from a bench that has imported torch and written an 8 GB checkpoint *is* that
bench until it execs (fork copies its page tables; vfork shares its mm). Seen here: a GGUF
export whose own peak is 0.47 GiB reported 0.78-0.84 GiB, the bench's size, for ours and the
upstream converter alike. So the command is started by a small launcher (``python -S``,
~10 MiB) that forks it from *its* image and reports the grandchild's ``wait4`` usage.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_LAUNCHER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"exit": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}, f)
"""
"""Forks the command from a ~10 MiB interpreter: the measured floor is that, not the bench."""


def run_measured(
    argv: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``argv`` (stdout and stderr to ``log``); ``{"exit", "wall_s", "peak_rss"}`` with
    the command's own peak RSS in bytes."""
    fd, report = tempfile.mkstemp(prefix="measure-", suffix=".json")
    os.close(fd)
    try:
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            subprocess.run(
                [sys.executable, "-S", "-c", _LAUNCHER, report, *argv],
                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=True,
            )  # fmt: skip
        wall = time.perf_counter() - t0
        result = json.loads(Path(report).read_text())
    finally:
        os.unlink(report)
    return {"exit": result["exit"], "wall_s": round(wall, 2),
            "peak_rss": result["maxrss_kib"] * 1024}  # fmt: skip


def time_calls(profiled: Mapping[str, Iterable[str]]) -> list[tuple[str, float]]:
    """Wrap each named function of each module (``{"module": ["name", ...]}``) so that every
    call appends ``(name, wall seconds)`` to the returned list: where a job's seconds go, by
    its own steps, in the bench's process (the export benches' profiles share this)."""
    steps: list[tuple[str, float]] = []

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                steps.append((name, round(time.monotonic() - start, 2)))

        return wrapper

    for module_name, names in profiled.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, timed(name, getattr(module, name)))
    return steps
