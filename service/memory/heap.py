"""Giving freed heap memory back to the system, so a job's RSS tracks what it really holds.

Weights are re-read into fresh tensors and freed over and over. glibc serves allocations under
its mmap threshold (which rises to 32 MiB after a large block is freed) from the heap, and a
freed block in the middle of the heap stays resident: a 16 MiB attention weight freed between
two live ones is never returned. Over a few passes of a many-layer model that fragmentation
adds hundreds of MiB to the peak, growing with the layer count. ``malloc_trim`` releases the
free pages wherever they are, without making every allocation an mmap.

Where no trim runs (inside transformers' forward, the independent reference's pass over the
fixed text), a job process pins the threshold instead (:func:`pin_mmap_threshold`): a layer's
activations of a few MiB each (hidden 4096, two chunks of 128 tokens: 2-11 MiB) are then
mapped and unmapped, not left in the heap. Measured on a synthetic Llama (hidden 2048, 49152
vocabulary), the reference's anonymous memory grew 16.5 MiB a layer over that pass (12 layers,
3.27 GB: 619 MiB peak) and stays flat with the threshold pinned at 1 MiB (408 MiB), 37 s
instead of 59.
"""

from __future__ import annotations

from service.memory.libc import malloc_trim, set_mmap_threshold

MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations of this many bytes or more are mapped apart (a tensor's buffer, an activation);
smaller ones (Python objects, small tensors) stay in the heap."""


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; False where libc has no ``malloc_trim``."""
    return malloc_trim()


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` for this process (module
    doc); False where libc has no ``mallopt``."""
    return set_mmap_threshold(MMAP_THRESHOLD_BYTES)


def release_between_stages() -> bool:
    """Collect what a finished stage left in reference cycles, then return the free heap.

    A job runs its exports and their checks one after the other in one process. What each
    stage freed stays resident otherwise (cycles until the collector runs, free heap pages until
    something trims them: 100-200 MiB after transformers' reference, the ONNX capture or a
    safetensors check), and the next stage, a llama.cpp child included, runs on top of it: the
    job's peak became a sum of its stages' instead of their maximum."""
    import gc

    gc.collect()
    return release_free_heap()


class HeapTrimmer:
    """Calls :func:`release_free_heap` once every ``every_bytes`` of weights read."""

    def __init__(self, every_bytes: int = 64 * 2**20) -> None:
        self.every_bytes = every_bytes
        self._since = 0

    def __call__(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every_bytes:
            self._since = 0
            release_free_heap()
