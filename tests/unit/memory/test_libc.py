"""The C library calls behind service.memory.libc really happen on Linux: a wrapper that quietly
became a no-op (a renamed symbol, wrong argument types) would cost memory or orphan job processes
without any error, so each is checked for its effect here."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from service.memory import libc
from tests.fixtures.waiting import eventually


def test_madvise_dontneed_really_drops_the_pages() -> None:
    # On a private anonymous mapping, dropped pages read back as zeros: proof the call happened.
    size = 16 * mmap.PAGESIZE
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        m.write(b"\xff" * size)
        anchor = ctypes.c_char.from_buffer(m)
        try:
            assert libc.madvise_dontneed(ctypes.addressof(anchor), size)
        finally:
            del anchor
        assert m[:] == b"\0" * size


def test_sync_file_range_accepts_a_written_range(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * (1 << 20))
        assert libc.sync_file_range_write(fd, 0, 1 << 20)
    finally:
        os.close(fd)


def test_malloc_trim_is_available() -> None:
    assert libc.malloc_trim()


def test_parent_death_signal_kills_the_child_when_its_parent_dies(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    # The parent starts a grandchild that asks for SIGKILL on its parent's death, then exits.
    parent = textwrap.dedent(f"""
        import os, signal, sys, time
        r, w = os.pipe()
        if os.fork() == 0:
            from service.memory import libc
            ok = libc.set_parent_death_signal(signal.SIGKILL)
            open({str(pid_file)!r}, "w").write(f"{{os.getpid()}} {{ok}}")
            os.write(w, b"1")
            time.sleep(60)
            os._exit(0)
        os.read(r, 1)
        os._exit(0)
    """)
    subprocess.run(
        [sys.executable, "-c", parent], check=True, timeout=60, cwd=Path(__file__).parents[3]
    )
    pid_text, ok = pid_file.read_text().split()
    assert ok == "True"
    pid = int(pid_text)

    def gone() -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.split(")")[-1].split()[0] == "Z"

    eventually(gone, what=f"the grandchild {pid} killed when its parent exited", timeout=30)
