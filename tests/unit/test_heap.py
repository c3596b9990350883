"""Freed heap memory goes back to the system: real glibc allocations, real RSS."""

from __future__ import annotations

import ctypes
import ctypes.util

import psutil
import pytest

from service.heap import HeapTrimmer, release_free_heap

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
    monkeypatch.setattr("service.heap.release_free_heap", lambda: calls.append(1) or True)
    trim = HeapTrimmer(every_bytes=100)
    for _ in range(6):
        trim(40)
    assert len(calls) == 2  # at 120 bytes, then 120 more
