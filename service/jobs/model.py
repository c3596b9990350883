"""The job as a domain object: what was asked, where it stands, what it produced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from service.stage import Phase, PhaseTiming

__all__ = [
    "Artifact", "CallbackDelivery", "CallbackState", "Job", "JobError", "JobStatus", "Phase",
    "PhaseTiming", "Progress",
]


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


class CallbackState(StrEnum):
    """Where a job's completion callback stands (see service/jobs/callbacks.py)."""

    WAITING = "waiting"
    """The job has not ended yet."""
    PENDING = "pending"
    """The job ended; the callback is being delivered or waits for its next attempt."""
    DELIVERED = "delivered"
    """The receiver answered 2xx."""
    FAILED = "failed"
    """Given up: attempts used up, or refused by the egress policy."""


@dataclass(frozen=True)
class CallbackDelivery:
    """A job's completion callback: where it goes and how its delivery went so far."""

    url: str
    state: CallbackState
    attempts: int = 0
    """Attempts started (a POST in flight counts)."""
    next_attempt_at: datetime | None = None
    """When the next attempt is due (pending only)."""
    last_status_code: int | None = None
    last_error: str | None = None
    delivered_at: datetime | None = None


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
    """Sections the pipeline published (``source``, ``model``, ``verify``, ...): the job JSON
    shows each at its top level."""
    phases: tuple[PhaseTiming, ...] = ()
    """The phase timeline: every phase the job entered, when, and for how long."""
    attempts: int = 0
    tenant: str | None = None
    cancel_requested: bool = False
    worker: str | None = None
    """Who runs (or last ran) the job: ``host:pid`` of the pool or worker that claimed it."""
    version: int = 0
    """Grows with every stored change of the job."""
    callback: CallbackDelivery | None = None
    reserved_bytes: int = 0
    """What the job is expected to write, held against its tenant's artifact-bytes limit while
    it is queued or running (see :class:`service.jobs.store.admission.Admission`)."""
    reused_from: str | None = None
    """The job whose artifacts this one shares instead of computing them (result reuse)."""
    deleted_at: datetime | None = None
    """When the job's files were removed (DELETE or retention); the row stays as a tombstone."""

    def replace(self, **changes: Any) -> Job:
        return dataclasses.replace(self, **changes)
