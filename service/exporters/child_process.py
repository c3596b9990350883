"""Run a verifier (tract, onnxruntime) in a child process and read its peak RSS.

A runtime that holds every weight of an artifact in RAM must not do so in the job process,
whose own peak stays that of a tensor or two: in a child, that memory is returned the moment it
exits, a crash (or the OOM killer) fails the verification instead of the job, and the child's
peak RSS is read exactly from ``wait4``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from service.errors import VerificationFailed


def run_child(
    argv: Sequence[str],
    work: Path,
    what: str,
    check_abort: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``argv`` to completion; returns the child's peak RSS in bytes.

    ``check_abort`` is polled while it runs (a cancel kills it). A non-zero exit raises
    :class:`VerificationFailed` naming ``what`` and quoting the end of its stderr."""
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=work) as stderr:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if check_abort is not None:
                    check_abort()
                time.sleep(0.1)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        tail = stderr.read()[-2000:].decode("utf-8", "replace").strip()
    if code != 0:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        hint = " (out of memory?)" if code == -signal.SIGKILL else ""
        raise VerificationFailed(f"{what} {how}{hint} running the model: {tail[-500:]}")
    return int(usage.ru_maxrss) * 1024
