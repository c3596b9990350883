"""Start-up recovery: no job stays ``running`` forever after the service stopped under it.

Stages are idempotent (scratch is wiped, artifacts appear in one rename), so an interrupted
job is simply re-queued from scratch, up to ``max_attempts``; past that it fails with
``job_interrupted``.
"""

from __future__ import annotations

import logging

from service.config import Settings
from service.errors import JobInterrupted
from service.jobs.layout import JobLayout
from service.jobs.model import JobError, JobStatus
from service.jobs.store import JobStore

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


def recover_interrupted(store: JobStore, settings: Settings, job_ids: list[str] | None = None) -> int:
    """Re-queue or fail jobs left running (all of them, or ``job_ids``); returns how many."""
    ids = job_ids if job_ids is not None else store.ids_with_status([JobStatus.RUNNING])
    for job_id in ids:
        job = store.get(job_id)
        if job.status is not JobStatus.RUNNING:
            continue
        JobLayout.for_job(settings, job_id).discard()
        if job.cancel_requested:
            store.finish(job_id, JobStatus.CANCELLED, error=JobError("job_cancelled", "cancelled"))
        elif job.attempts >= MAX_ATTEMPTS:
            store.finish(
                job_id,
                JobStatus.FAILED,
                error=JobError(
                    JobInterrupted.code,
                    f"interrupted {job.attempts} times by service restarts; giving up",
                ),
            )
        else:
            store.requeue(job_id)
            log.info("re-queued interrupted job", extra={"job_id": job_id})
    return len(ids)
