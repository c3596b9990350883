"""What becomes of a running job whose process is gone without a result: no job stays
``running`` forever after the service, or a worker, stopped under it.

Stages are idempotent (scratch is wiped, artifacts appear in one rename), so an interrupted
job is simply re-queued from scratch, up to ``MAX_ATTEMPTS``; past that it fails with
``job_interrupted``. A job whose cancellation was asked is cancelled instead.

The local pool applies this at start-up to every job left running (:func:`recover_interrupted`);
distributed workers apply it to a job whose worker stopped heartbeating or shut down
(:func:`release_interrupted`, inside the transaction that also re-delivers the queue's job).
"""

from __future__ import annotations

import logging

from sqlalchemy.engine import Connection

from service.config import Settings
from service.errors import JobInterrupted
from service.jobs.layout import JobLayout
from service.jobs.model import Job, JobError, JobStatus
from service.jobs.store import JobStore

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


def release_interrupted(
    store: JobStore, job: Job, conn: Connection | None = None, why: str = "service restarts"
) -> JobStatus:
    """Move the running ``job`` to cancelled, failed (attempts used up) or queued; returns which.

    The caller removes the attempt's files (after its transaction commits)."""
    if job.cancel_requested:
        store.finish(
            job.id, JobStatus.CANCELLED, error=JobError("job_cancelled", "cancelled"), conn=conn
        )
        return JobStatus.CANCELLED
    if job.attempts >= MAX_ATTEMPTS:
        store.finish(
            job.id,
            JobStatus.FAILED,
            error=JobError(
                JobInterrupted.code, f"interrupted {job.attempts} times by {why}; giving up"
            ),
            conn=conn,
        )
        return JobStatus.FAILED
    store.requeue(job.id, conn=conn)
    log.info("re-queued interrupted job", extra={"job_id": job.id, "attempts": job.attempts})
    return JobStatus.QUEUED


def recover_interrupted(store: JobStore, settings: Settings, job_ids: list[str] | None = None) -> int:
    """Re-queue or fail jobs left running (all of them, or ``job_ids``); returns how many."""
    ids = job_ids if job_ids is not None else store.ids_with_status([JobStatus.RUNNING])
    for job_id in ids:
        job = store.get(job_id)
        if job.status is not JobStatus.RUNNING:
            continue
        JobLayout.for_job(settings, job_id).discard()
        release_interrupted(store, job)
    return len(ids)
