"""What the API needs of whatever runs jobs: accept, cancel, start and stop."""

from __future__ import annotations

from typing import Protocol

from service.config import Settings
from service.jobs.model import Job
from service.jobs.store import Admission


def admission(settings: Settings) -> Admission:
    """The limits every executor checks inside the transaction that inserts a job."""
    return Admission(
        max_queued=settings.max_queued,
        tenant_max_queued=settings.tenant_max_queued,
        tenant_max_active=settings.tenant_max_active,
        tenant_max_artifact_bytes=settings.tenant_max_artifact_bytes,
    )


class Executor(Protocol):
    def start(self) -> None:
        """Begin running queued jobs (after recovery of interrupted ones)."""
        ...

    def stop(self) -> None:
        """Stop taking jobs; running ones are stopped and left for recovery to re-queue."""
        ...

    def submit(self, job: Job, secrets: dict[str, str]) -> Job:
        """Persist ``job`` as queued and arrange for it to run; QueueFull under back-pressure.

        ``secrets`` (per-job tokens) are kept in memory only and handed to the job process."""
        ...

    def cancel(self, job_id: str, tenant: str | None = None) -> Job:
        """Cancel a queued or running job; a running job's process is gone within seconds."""
        ...
