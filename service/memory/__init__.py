"""The memory this process really has, each job's share of it, and keeping a job inside it.

The map:

- ``budget``: :class:`MemoryLimit`, :class:`MemoryBudget` (the API's share, then the rest
  divided by the pool size for each job with every child it starts).
- ``cgroups``: the limit this process lives under (:func:`read_memory_limit`: cgroup v2 or v1,
  else the host), and a job's own memory cgroup (:class:`JobCgroup`).
- ``procfs``: the ``/proc`` readers: the host's total, a process group's private bytes (the
  executor's accounting where no cgroup can be made), this process's RSS and peak, a child's
  ``status`` fields.
- ``heap``: giving freed heap back to the system (``malloc_trim``, a pinned mmap threshold).
- ``libc``: the few C library calls the service makes, from one ``ctypes`` handle.

A leaf: it imports nothing else of the service, so the settings, the executors and the stages
can all read it.
"""

from service.memory.budget import MemoryBudget, MemoryLimit, default_job_budget
from service.memory.cgroups import JobCgroup, read_memory_limit, stale_job_cgroups
from service.memory.procfs import (
    current_rss,
    host_memory,
    peak_rss,
    process_group_private_bytes,
    reset_peak_rss,
    status_bytes,
)

__all__ = [
    "JobCgroup", "MemoryBudget", "MemoryLimit", "current_rss", "default_job_budget",
    "host_memory", "peak_rss", "process_group_private_bytes", "read_memory_limit",
    "reset_peak_rss", "stale_job_cgroups", "status_bytes",
]
