"""The job as a domain object: what was asked, where it stands, what it produced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from service.stage import Phase

__all__ = ["Artifact", "Job", "JobError", "JobStatus", "Phase", "Progress"]


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass(frozen=True)
class Progress:
    done: int = 0
    total: int | None = None
    unit: str = "bytes"


@dataclass(frozen=True)
class JobError:
    type: str
    message: str


@dataclass(frozen=True)
class Artifact:
    """A file in the job's artifact directory; ``path`` is relative to it, POSIX style."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Job:
    id: str
    status: JobStatus
    phase: Phase
    spec: dict[str, Any]
    created_at: datetime
    progress: Progress = field(default_factory=Progress)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: JobError | None = None
    artifacts: tuple[Artifact, ...] = ()
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    tenant: str | None = None
    cancel_requested: bool = False
    worker: str | None = None
    """Who runs (or last ran) the job: ``host:pid`` of the pool or worker that claimed it."""
    version: int = 0
    """Grows with every stored change of the job."""

    def replace(self, **changes: Any) -> Job:
        return dataclasses.replace(self, **changes)
