"""Run a verifier (tract, onnxruntime) or a tool (llama-quantize) in a child and read its peak RSS.

A runtime that holds every weight of an artifact in RAM must not do so in the job process,
whose own peak stays that of a tensor or two: in a child, that memory is returned the moment it
exits, and a crash (or the OOM killer) fails the verification instead of the job.

The child's peak RSS is its own, not the job's. ``wait4``'s ``ru_maxrss`` alone is not: Linux
records the pre-``exec`` image's high-water mark in the child's (``exec_mmap`` sets
``signal->maxrss`` from the old mm, which after ``vfork`` is this process's own), so a 5 MiB
tool started by a 2 GiB job reports 2 GiB. :func:`run_child` therefore reads this process's
``VmHWM`` once the child has called ``exec`` (an upper bound of what the child inherited) and samples
the ``VmHWM`` of the child and its descendants every :data:`SAMPLE_SECONDS` while it runs
(``VmHWM`` counts from ``exec``, and is monotonic, so sampling misses only what the child adds in
its last interval). ``ru_maxrss`` above the inherited bound is the child's own peak exactly;
otherwise the figure is the last sample, exact unless the child grew in its last few
milliseconds (a child that ended before the first sample keeps ``ru_maxrss``, an upper bound).

RSS counts the resident pages of the files a child maps. llama.cpp's tools map the GGUF file
they check, so their RSS grows with the file although those pages are page cache the kernel
reclaims under a memory limit (a job's cgroup does). The same samples also read ``RssAnon``,
whose largest value (:attr:`ChildPeaks.anon`) is what the child holds and cannot give back: the
figure that must not grow with the model. Linux keeps no high-water mark of it, so it is sampled
(a rise and fall within one interval is missed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import ServiceError, VerificationFailed, VerificationTooLarge
from service.memory import peak_rss, status_bytes
from service.units import parse_size

SAMPLE_SECONDS = 0.005
"""How often a running child's ``VmHWM`` is read (16 µs a read: 0.3% of a core)."""

POLL_SECONDS = 0.1
"""How often ``check_abort``, ``on_poll`` and the timeout are looked at."""

TREE_SECONDS = 0.25
"""How often the child's descendants are looked up (a tool a shell runs: about 2 ms a scan of
``/proc``, which has no ``children`` file on kernels built without ``CONFIG_PROC_CHILDREN``)."""


def descendants(root: int) -> set[int]:
    """``root`` and every process below it now, from each process's parent in ``/proc``."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {root}, [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass(frozen=True)
class ChildPeaks:
    rss: int
    """The child's own peak RSS in bytes (module doc), mapped file pages included."""
    anon: int | None
    """The largest anonymous memory sampled in the child's tree at once, in bytes; None for a
    child that ended before the first sample."""


def own_peak(reported: int, inherited: int, sampled: int) -> int:
    """The child's own peak RSS from ``wait4``'s ``reported`` figure, the ``inherited`` bound
    (this process's ``VmHWM`` after the child's ``exec``) and the largest ``VmHWM`` sampled in
    the child's tree (module doc): ``reported`` when above what it may have inherited, else the
    sample (``reported`` if there is none)."""
    if reported > inherited or sampled == 0:
        return reported
    return sampled


def run_child(
    argv: Sequence[str],
    work: Path,
    what: str,
    check_abort: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
    *,
    log: Path | None = None,
    on_poll: Callable[[], None] | None = None,
    timeout: float | None = None,
    error: type[ServiceError] = VerificationFailed,
) -> ChildPeaks:
    """Run ``argv`` to completion; returns the child's own peak RSS and its anonymous peak
    (module doc).

    ``check_abort`` and ``on_poll`` are called while it runs (a cancel kills it); with ``log``
    its stdout and stderr both go to that file, where ``on_poll`` can read its progress (else
    stdout is discarded and stderr kept in a temporary file). Past ``timeout`` seconds it is
    killed. A non-zero exit or a timeout raises ``error`` (by default
    :class:`VerificationFailed`) naming ``what`` and quoting the end of its stderr."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w+b") if log is not None else tempfile.TemporaryFile(dir=work) as stderr:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL,
            stdout=stderr if log is not None else subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        inherited = peak_rss() or 0  # vfork: the child's pre-exec image was this process's
        sampled, anon, tree = 0, 0, {proc.pid}
        next_poll = next_tree = 0.0
        try:
            while True:
                tree_anon = 0
                for member in tree:
                    now_of = status_bytes(Path(f"/proc/{member}"), "VmHWM", "RssAnon")
                    sampled = max(sampled, now_of.get("VmHWM", 0))
                    tree_anon += now_of.get("RssAnon", 0)
                anon = max(anon, tree_anon)
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                now = time.monotonic()
                if now >= next_tree:
                    tree, next_tree = descendants(proc.pid), now + TREE_SECONDS
                if now >= next_poll:
                    next_poll = now + POLL_SECONDS
                    if check_abort is not None:
                        check_abort()
                    if on_poll is not None:
                        on_poll()
                    if timeout is not None and now - started > timeout:
                        raise error(f"{what} did not finish within {timeout:.0f} s; it was killed")
                time.sleep(SAMPLE_SECONDS)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, stderr.tell() - 2000))
        tail = stderr.read().decode("utf-8", "replace").strip()
    if code != 0:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        hint = " (out of memory?)" if code == -signal.SIGKILL else ""
        raise error(f"{what} {how}{hint}: {tail[-500:]}")
    return ChildPeaks(own_peak(int(usage.ru_maxrss) * 1024, inherited, sampled), anon or None)


@dataclass(frozen=True)
class ChildRun:
    outputs: dict[str, np.ndarray]
    peak_rss_bytes: int


def run_npz_child(
    argv: Callable[[Path, Path], Sequence[str]],
    request: dict[str, np.ndarray],
    work: Path,
    what: str,
    check_abort: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
) -> ChildRun:
    """Run a runtime that reads its inputs from an npz file and writes its outputs to another.

    ``argv(request_path, outputs_path)`` is the command line. The peak RSS is the child's own
    ``peak_rss_bytes`` output when it writes one (a child that can tell its own ``VmHWM``), else
    what :func:`run_child` measures."""
    work.mkdir(parents=True, exist_ok=True)
    request_path, outputs_path = work / "request.npz", work / "outputs.npz"
    np.savez(request_path, **request)  # type: ignore[arg-type]
    peak = run_child(argv(request_path, outputs_path), work, what, check_abort, env=env).rss
    with np.load(outputs_path) as bundle:
        outputs = {k: bundle[k] for k in bundle.files}
    if "peak_rss_bytes" in outputs:
        peak = int(outputs.pop("peak_rss_bytes"))
    return ChildRun(outputs, peak)


def memory_limit(setting: str | None) -> int:
    """Bytes a verifier child may take: the setting, else 90% of what the machine has now."""
    if setting is not None:
        return parse_size(setting)
    import psutil

    return int(psutil.virtual_memory().available * 0.9)


def ensure_fits(runtime: str, need: int, setting: str | None, setting_name: str) -> None:
    """Refuse up front a verification ``runtime`` cannot hold: tract and onnxruntime read every
    weight into RAM, so their need grows with the model, unlike the export's."""
    limit = memory_limit(setting)
    if need > limit:
        raise VerificationTooLarge(
            f"{runtime} needs about {need / 2**30:.1f} GiB of RAM to run this model (it holds "
            f"every weight), more than the {limit / 2**30:.1f} GiB this worker allows "
            f'({setting_name}); export with "verify": false, or on a bigger worker'
        )
