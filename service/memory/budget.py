"""Each job's share of the memory this process really has: the API keeps its share (the API
process and the job forkserver), and the rest divided by the pool size is what one job, with
every child it starts, may use."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryLimit:
    """The most memory this process may use, and where that figure comes from."""

    bytes: int
    source: str
    """``cgroup2:<dir>/memory.max`` (or ``memory.high``), ``cgroup1:<dir>``, or ``host``."""

@dataclass(frozen=True)
class MemoryBudget:
    """How the limit is shared: the API keeps ``api_share``, each of ``workers`` jobs gets
    ``job`` bytes (its process group: the job process and every child it starts)."""

    limit: int
    limit_source: str
    api_share: int
    workers: int
    job: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

def default_job_budget(limit: int, api_share: int, workers: int) -> int:
    """The limit, less the API's share, divided by the pool size."""
    return max(0, limit - api_share) // workers
