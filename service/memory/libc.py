"""The few C library calls the service makes, from one ``ctypes`` handle loaded once.

Each wraps a Linux/glibc call that Python's ``os`` module lacks and that only ever helps: where
the C library or the call is missing (not Linux, not glibc) the wrapper does nothing and says so
(False), and the caller carries on without the optimisation.

* ``madvise(MADV_DONTNEED)``: drop pages of a read-only file mapping from RSS (torch pickles).
* ``sync_file_range(WRITE)``: start writeback of a written range now (the safetensors writer).
* ``malloc_trim``: give freed heap pages back (:mod:`service.memory.heap`).
* ``mallopt(M_MMAP_THRESHOLD)``: a fixed mmap threshold for a job's allocations
  (:mod:`service.memory.heap`).
* ``prctl(PR_SET_PDEATHSIG)``: a job process dies with its parent (:mod:`service.jobs.runner`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

_MADV_DONTNEED = 4
_SYNC_FILE_RANGE_WRITE = 2
_PR_SET_PDEATHSIG = 1
_M_MMAP_THRESHOLD = -3


def _load() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to open
        return None
    for name, argtypes, restype in (
        ("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int),
        (
            "sync_file_range",
            [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
            ctypes.c_int,
        ),
        ("malloc_trim", [ctypes.c_size_t], ctypes.c_int),
        ("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int),
        ("prctl", [ctypes.c_int, ctypes.c_ulong], ctypes.c_int),
    ):
        function = getattr(libc, name, None)
        if function is not None:
            function.argtypes = argtypes
            function.restype = restype
    return libc


_LIBC = _load()


def _function(name: str) -> Callable[..., Any] | None:
    return getattr(_LIBC, name, None) if _LIBC is not None else None


def madvise_dontneed(address: int, length: int) -> bool:
    """``madvise(address, length, MADV_DONTNEED)``; ``address`` must be page-aligned."""
    function = _function("madvise")
    return function is not None and int(function(address, length, _MADV_DONTNEED)) == 0


def sync_file_range_write(fd: int, offset: int, length: int) -> bool:
    """Start writeback of ``[offset, offset + length)`` of ``fd`` without waiting for it."""
    function = _function("sync_file_range")
    return function is not None and int(function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)) == 0


def malloc_trim() -> bool:
    """``malloc_trim(0)``: return the heap's free pages to the system (False: no glibc)."""
    function = _function("malloc_trim")
    if function is None:
        return False
    function(0)
    return True


def set_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)``: allocations of ``nbytes`` or more are mapped
    apart and unmapped when freed; setting it also stops glibc raising it by itself."""
    function = _function("mallopt")
    return function is not None and int(function(_M_MMAP_THRESHOLD, nbytes)) == 1


def set_parent_death_signal(signal: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signal)``: this process gets ``signal`` when its parent dies."""
    function = _function("prctl")
    return function is not None and int(function(_PR_SET_PDEATHSIG, signal)) == 0
