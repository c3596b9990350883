"""The memory limit the service lives under, read from a /proc and cgroup tree laid out as Linux
lays them out (written under tmp_path), and the budget the settings derive from it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.config import JOB_PROCESS_SHARE, Settings
from service.memory import (
    default_job_budget,
    peak_rss,
    process_group_private_bytes,
    read_memory_limit,
    reset_peak_rss,
    status_bytes,
)

GiB = 2**30
MiB = 2**20


def _proc(tmp: Path, cgroup_lines: list[str], mounts: list[str], mem_total: int = 64 * GiB) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {mem_total // 1024} kB\nMemFree: 1 kB\n")
    (proc / "self" / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    (proc / "self" / "mountinfo").write_text("\n".join(mounts) + "\n")
    return proc


def _v1_mount(point: Path, root: str = "/") -> str:
    return f"35 31 0:32 {root} {point} rw,relatime - cgroup cgroup rw,memory"


def _v2_mount(point: Path, root: str = "/") -> str:
    return f"41 31 0:38 {root} {point} rw,relatime - cgroup2 cgroup2 rw"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_without_a_cgroup_limit_the_host_memory_is_the_limit(tmp_path: Path) -> None:
    v1 = tmp_path / "memory"
    _write(v1 / "pod" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    proc = _proc(tmp_path, ["4:memory:/pod", "0::/"], [_v1_mount(v1)], mem_total=8 * GiB)
    limit = read_memory_limit(proc)
    assert (limit.bytes, limit.source) == (8 * GiB, "host")


def test_cgroup_v1_limit_is_the_smallest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    v1 = tmp_path / "memory"
    _write(v1 / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(v1 / "kubepods" / "memory.limit_in_bytes", str(3 * GiB))
    _write(v1 / "kubepods" / "pod1" / "memory.limit_in_bytes", str(5 * GiB))
    proc = _proc(tmp_path, ["4:memory:/kubepods/pod1"], [_v1_mount(v1)])
    limit = read_memory_limit(proc)
    assert limit.bytes == 3 * GiB
    assert limit.source == f"cgroup1:{v1 / 'kubepods'}"


def test_cgroup_v2_memory_high_below_memory_max_is_the_limit(tmp_path: Path) -> None:
    v2 = tmp_path / "unified"
    _write(v2 / "pod" / "memory.max", str(4 * GiB))
    _write(v2 / "pod" / "memory.high", str(3 * GiB))
    _write(v2 / "pod" / "svc" / "memory.max", "max\n")
    _write(v2 / "pod" / "svc" / "memory.high", "max\n")
    proc = _proc(tmp_path, ["0::/pod/svc"], [_v2_mount(v2)])
    limit = read_memory_limit(proc)
    assert limit.bytes == 3 * GiB
    assert limit.source == f"cgroup2:{v2 / 'pod' / 'memory.high'}"


def test_a_cgroup_namespace_shows_its_own_cgroup_as_the_mount_point(tmp_path: Path) -> None:
    # Inside a container with its own cgroup namespace, /proc/self/cgroup says "/" and the
    # mount's root is the container's cgroup: the limit is at the mount point.
    v2 = tmp_path / "unified"
    _write(v2 / "memory.max", str(2 * GiB))
    proc = _proc(tmp_path, ["0::/"], [_v2_mount(v2, root="/docker/abc")])
    assert read_memory_limit(proc).bytes == 2 * GiB


def test_the_job_budget_is_the_limit_less_the_api_share_over_the_pool() -> None:
    assert default_job_budget(2560 * MiB, 512 * MiB, 2) == 1024 * MiB
    assert default_job_budget(256 * MiB, 512 * MiB, 1) == 0


def test_settings_derive_every_memory_default_from_the_limit(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path, memory_limit="2560MiB", api_memory="512MiB", workers=2
    )
    budget = settings.memory_budget
    assert (budget.limit, budget.job, budget.limit_source) == (
        2560 * MiB, 1024 * MiB, "MODELPREP_MEMORY_LIMIT"
    )
    verifier = 1024 * MiB - JOB_PROCESS_SHARE
    assert settings.tract_max_memory == settings.ort_max_memory == str(verifier)
    assert settings.offload_memory == str(256 * MiB)
    # what the operator sets wins, and a job budget of nothing is refused at start-up
    assert Settings(data_dir=tmp_path, memory_limit="4GiB", job_memory="3GiB").job_memory == 3 * GiB
    try:
        Settings(data_dir=tmp_path, memory_limit="256MiB")
    except ValueError as exc:
        assert "no memory left for jobs" in str(exc)
    else:
        raise AssertionError("a limit below the API's share was accepted")


def test_settings_read_the_real_limit_once_when_none_is_given(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    found = read_memory_limit()
    assert (settings.memory_limit, settings.memory_limit_source) == (found.bytes, found.source)
    # a job process receives the figures with the settings rather than re-reading them
    again = Settings.model_validate_json(settings.model_dump_json())
    assert again.memory_budget == settings.memory_budget


_MAP_FILE = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
touched = sum(m[i] for i in range(0, len(m), 4096))  # every page read in: resident, clean
print("ready", touched, flush=True)
sys.stdin.read()
"""
"""A child that maps a file read-only and reads every page of it, as llama.cpp maps the GGUF
it checks: the pages are resident and clean, the kernel's to drop."""

_ALLOCATE = """
import sys
block = bytearray(int(sys.argv[1]))
block[::4096] = b"x" * len(block[::4096])  # every page written: anonymous, dirty
print("ready", flush=True)
sys.stdin.read()
"""
"""A child that allocates anonymous memory and writes every page of it."""


@contextmanager
def _child_group(script: str, arg: str) -> Iterator[int]:
    """A real Python child leading its own process group, once it has said it is ready; its
    process group id, which is its pid."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        process_group=0, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("ready")
        yield child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()


def test_a_process_group_is_held_to_its_anonymous_memory_not_the_clean_pages_it_maps(
    tmp_path: Path,
) -> None:
    size = 96 * MiB
    mapped = tmp_path / "weights.gguf"
    with open(mapped, "wb") as f:
        f.writelines(os.urandom(MiB) for _ in range(size // MiB))
        os.fsync(f.fileno())  # written back: a page the kernel has not written yet is dirty
    with _child_group(_MAP_FILE, str(mapped)) as pgid:
        resident_file = status_bytes(Path(f"/proc/{pgid}"), "RssFile")["RssFile"]
        mapping = process_group_private_bytes(pgid)
    with _child_group(_ALLOCATE, str(size)) as pgid:
        allocating = process_group_private_bytes(pgid)
    # the mapped file was all resident in the child, yet not held against its group...
    assert resident_file >= size, resident_file
    assert mapping < size // 2, mapping
    # ...while the same bytes allocated are, on top of what an interpreter holds anyway
    assert allocating - mapping >= size - 8 * MiB, (allocating, mapping)


def test_a_process_group_private_memory_counts_what_it_allocated() -> None:
    before = process_group_private_bytes(os.getpgid(0))
    block = bytearray(64 * MiB)
    block[:: 4096] = b"x" * len(block[:: 4096])
    after = process_group_private_bytes(os.getpgid(0))
    assert after - before >= 60 * MiB
    del block


def test_the_peak_rss_of_a_phase_starts_again_after_a_reset() -> None:
    block = bytearray(64 * MiB)
    block[:: 4096] = b"x" * len(block[:: 4096])
    high = peak_rss()
    del block
    assert reset_peak_rss()
    low = peak_rss()
    assert high is not None and low is not None
    assert high - low >= 60 * MiB
