"""Freed heap memory goes back to the system: real glibc allocations, real RSS."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from service.memory.heap import HeapTrimmer, release_free_heap

BLOCK = 64 * 1024  # under glibc's mmap threshold: served from the heap
COUNT = 2048  # 128 MiB


@pytest.fixture()
def libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c")
    assert name is not None
    lib = ctypes.CDLL(name)
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]
    return lib


def test_free_blocks_under_a_live_one_are_returned_only_by_a_trim(libc: ctypes.CDLL) -> None:
    rss = psutil.Process().memory_info
    blocks = [libc.malloc(BLOCK) for _ in range(COUNT)]
    pin = libc.malloc(BLOCK)  # a live block above them: the heap top cannot shrink
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)
    for block in blocks:
        libc.free(block)
    freed_but_resident = rss().rss
    assert release_free_heap()
    after = rss().rss
    libc.free(pin)
    assert freed_but_resident - after > COUNT * BLOCK // 2


def test_trimmer_trims_once_per_budget_of_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr("service.memory.heap.release_free_heap", counted)
    trim = HeapTrimmer(every_bytes=100)
    for _ in range(6):
        trim(40)
    assert len(calls) == 2  # at 120 bytes, then 120 more


FRAGMENTS = """
import ctypes, ctypes.util, sys
from service.memory.heap import pin_mmap_threshold
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("RssAnon")) << 10
if sys.argv[1] == "pinned":
    assert pin_mmap_threshold()
libc.free(libc.malloc(16 << 20))  # a large block freed: glibc raises its threshold to 16 MiB
before = anon()
blocks, pins = [], []
for _ in range(20):  # 4 MiB activations, each followed by a smaller block that stays
    blocks.append(libc.malloc(4 << 20))
    ctypes.memset(blocks[-1], 1, 4 << 20)
    pins.append(libc.malloc(200 << 10))  # from the heap top: the blocks cannot coalesce
for block in blocks:
    libc.free(block)
print(anon() - before)
"""


@pytest.mark.parametrize("mode", ["pinned", "dynamic"])
def test_a_pinned_mmap_threshold_returns_freed_activations_a_raised_one_keeps(mode: str) -> None:
    """A job pins glibc's mmap threshold (service.memory.heap.pin_mmap_threshold): 80 MiB of 4 MiB
    blocks freed between live small ones go back; with glibc's own threshold, raised by one
    freed 16 MiB block, they stay resident (what grew a job's reference 16 MiB a layer)."""
    root = str(Path(__file__).resolve().parents[3])  # this checkout's service package
    done = subprocess.run(
        [sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    kept = int(done.stdout.strip())
    if mode == "pinned":
        assert kept < 8 << 20, f"{kept >> 20} MiB kept"
    else:
        assert kept > 60 << 20, f"{kept >> 20} MiB kept: glibc no longer raises its threshold"
