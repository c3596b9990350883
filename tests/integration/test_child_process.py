"""A child's peak RSS is its own, not the job's that started it (``run_child``).

Linux hands the pre-``exec`` image's high-water mark to the child's ``ru_maxrss``, so a small
tool started by this process while it holds 1 GiB reports 1 GiB from ``wait4``. Each child here
is real; the Python ones write their own ``VmHWM`` just before they exit, the figure
``run_child`` must return (within 4 MiB: the pages the child touches to write it). Each holds its
peak 0.3 s before exiting, as the real consumers do (they hold the model until they end):
``run_child`` samples every 5 ms, and a peak reached in a child's last few milliseconds would be
read as the last sample before it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.exporters.common.child_process import run_child
from service.memory import current_rss

MiB = 1 << 20
TOLERANCE = 4 * MiB

CHILD = """
import sys, time
held = b"x" * (int(sys.argv[1]) << 20)  # touched: every page resident
time.sleep(0.3)
with open("/proc/self/status") as status:
    hwm = next(line for line in status if line.startswith("VmHWM:"))
with open(sys.argv[2], "w") as out:
    out.write(str(int(hwm.split()[1]) * 1024))
"""


@pytest.fixture(scope="module")
def holding_a_gib() -> Iterator[np.ndarray]:
    """This process with 1 GiB more resident, as a job holding a block when a child starts."""
    block = np.ones(1 << 27, dtype=np.float64)  # 1 GiB, written: resident
    rss = current_rss()
    assert rss is not None and rss > 1 << 30
    yield block
    del block


def _python_child(tmp_path: Path, mib: int) -> tuple[list[str], Path]:
    truth = tmp_path / f"vmhwm-{mib}"
    return [sys.executable, "-S", "-c", CHILD, str(mib), str(truth)], truth


def _inflated(argv: list[str]) -> int:
    """What ``wait4`` alone reports for ``argv`` started from this process."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    return int(os.wait4(proc.pid, 0)[2].ru_maxrss) * 1024


def test_a_small_child_of_a_big_process_reports_its_own_peak_not_the_parents(
    holding_a_gib: np.ndarray, tmp_path: Path
) -> None:
    argv, truth = _python_child(tmp_path, 64)
    assert _inflated(argv) > 1 << 30, "wait4 no longer inherits the parent's peak: simplify"
    peak = run_child(argv, tmp_path, "python").rss
    own = int(truth.read_text())
    assert 64 * MiB < own < 128 * MiB
    assert abs(peak - own) <= TOLERANCE, f"measured {peak / MiB:.0f} MiB, own {own / MiB:.0f} MiB"


def test_a_child_bigger_than_its_parent_is_read_exactly_from_wait4(
    holding_a_gib: np.ndarray, tmp_path: Path
) -> None:
    argv, truth = _python_child(tmp_path, 1536)
    peak = run_child(argv, tmp_path, "python").rss
    own = int(truth.read_text())
    assert own > 1536 * MiB
    assert abs(peak - own) <= TOLERANCE, f"measured {peak / MiB:.0f} MiB, own {own / MiB:.0f} MiB"


def test_a_tool_a_shell_runs_reports_the_tools_peak(
    holding_a_gib: np.ndarray, tmp_path: Path
) -> None:
    """As llama-mtmd-cli runs: a shell starts the tool in the background and waits for it."""
    argv, truth = _python_child(tmp_path, 96)
    script = '"$@" & wait $!'
    peak = run_child(["/bin/sh", "-c", script, "sh", *argv], tmp_path, "sh").rss
    own = int(truth.read_text())
    assert abs(peak - own) <= TOLERANCE, f"measured {peak / MiB:.0f} MiB, own {own / MiB:.0f} MiB"


def test_a_native_tool_of_a_few_mib_reports_a_few_mib(
    holding_a_gib: np.ndarray, tmp_path: Path
) -> None:
    peak = run_child(["sleep", "0.3"], tmp_path, "sleep").rss
    assert 0 < peak < 8 * MiB, f"sleep measured at {peak / MiB:.0f} MiB"


MAPPER = """
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    total = sum(view[i] for i in range(0, len(view), 4096))  # every page resident
held = b"y" * (int(sys.argv[2]) << 20)
time.sleep(0.3)
"""


def test_a_child_that_maps_a_file_reports_the_files_pages_in_rss_not_in_anon(
    tmp_path: Path,
) -> None:
    """As llama.cpp's tools do with the GGUF they check: the mapped file's resident pages count
    in the child's RSS (they grow with the file; the kernel reclaims them under a limit), not in
    its anonymous peak, which is what it holds (32 MiB here) and must stay flat."""
    mapped = tmp_path / "weights.bin"
    with open(mapped, "wb") as out:
        out.write(os.urandom(256 * MiB))
    peaks = run_child([sys.executable, "-S", "-c", MAPPER, str(mapped), "32"], tmp_path,
                            "python")  # fmt: skip
    assert peaks.rss > 256 * MiB, f"rss {peaks.rss / MiB:.0f} MiB"
    assert peaks.anon is not None
    assert 32 * MiB < peaks.anon < 64 * MiB, f"anon {peaks.anon / MiB:.0f} MiB"


def test_a_tool_a_shell_runs_reports_its_anonymous_peak(tmp_path: Path) -> None:
    """The anonymous peak is the tree's: the shell's and the tool's (96 MiB held) at once."""
    argv, _ = _python_child(tmp_path, 96)
    peaks = run_child(["/bin/sh", "-c", '"$@" & wait $!', "sh", *argv], tmp_path, "sh")
    assert peaks.anon is not None
    assert 96 * MiB < peaks.anon < 128 * MiB, f"anon {peaks.anon / MiB:.0f} MiB"
