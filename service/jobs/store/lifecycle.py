"""The job lifecycle: queued -> running -> succeeded / failed / cancelled, and back to queued
when a worker dies; then the removal of a finished job's files.

Every state change is a single UPDATE guarded by the expected current status, so the API
process, the local pool and job child processes (each with its own engine) can write
concurrently without lost updates: claiming a job, finishing it and cancelling it race
safely. Secrets are never written here. Functions on a connection (the caller's transaction);
:class:`service.jobs.store.JobStore` opens it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from service.errors import Conflict
from service.jobs import totals
from service.jobs.model import Artifact, Job, JobError, JobStatus, Phase, PhaseTiming, Progress
from service.jobs.store.admission import Admission, admit, check_artifact_room
from service.jobs.store.callbacks import due_when_ended
from service.jobs.store.reads import get
from service.jobs.store.schema import (
    NEXT_VERSION,
    jobs_table,
    phases_json,
    to_job,
    to_row,
    utcnow,
)
from service.jobs.store.totals import add_totals
from service.jobs.totals import TotalKey


def _running(job_id: str) -> Any:
    return (jobs_table.c.id == job_id) & (jobs_table.c.status == JobStatus.RUNNING.value)


def insert(conn: Connection, job: Job, limits: Admission | None = None) -> None:
    """Insert ``job`` (queued) within the caller's transaction (a distributed executor
    enqueues in the same one), after checking ``limits`` (QueueFull / TenantLimitExceeded)
    under the submit lock: concurrent submits are serialized and a limit is never overshot."""
    admit(conn, job.tenant, job.reserved_bytes, limits)
    conn.execute(jobs_table.insert().values(**to_row(job)))
    if job.status.terminal:  # inserted ended (an import, a test): its figures count too
        add_totals(conn, totals.ended_figures(job))


def claim(conn: Connection, job_id: str, worker: str) -> bool:
    """Move a queued job to running for ``worker``; False if someone else got it first.

    The phase moves on to the first one the pipeline runs (download), so that no job is
    ever seen ``running`` in phase ``queued`` while its process starts."""
    now = utcnow()
    result = conn.execute(
        update(jobs_table)
        .where(jobs_table.c.id == job_id, jobs_table.c.status == JobStatus.QUEUED.value)
        .values(
            version=NEXT_VERSION,
            status=JobStatus.RUNNING.value,
            started_at=now,
            updated_at=now,
            heartbeat_at=now,
            worker=worker,
            attempts=jobs_table.c.attempts + 1,
            phase=Phase.DOWNLOAD.value,
            progress_done=0,
            progress_total=None,
            progress_unit="bytes",
        )
    )
    return result.rowcount == 1


def _reported(
    progress: Progress | None,
    metrics: dict[str, Any] | None,
    details: dict[str, Any] | None,
    phases: Sequence[PhaseTiming] | None,
) -> dict[str, Any]:
    """The values of what a running or ending job reports (None: unchanged)."""
    values: dict[str, Any] = {}
    if progress is not None:
        values.update(
            progress_done=progress.done,
            progress_total=progress.total,
            progress_unit=progress.unit,
        )
    if metrics is not None:
        values["metrics"] = metrics
    if details is not None:
        values["details"] = details
    if phases is not None:
        values["phases"] = phases_json(phases)
    return values


def report(
    conn: Connection,
    job_id: str,
    *,
    phase: Phase | None = None,
    progress: Progress | None = None,
    metrics: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
    phases: Sequence[PhaseTiming] | None = None,
) -> bool:
    """Record progress of a running job; False once it is no longer running (cancelled)."""
    now = utcnow()
    values: dict[str, Any] = {
        "updated_at": now,
        "heartbeat_at": now,
        "version": NEXT_VERSION,
        **_reported(progress, metrics, details, phases),
    }
    if phase is not None:
        values["phase"] = phase.value
    result = conn.execute(update(jobs_table).where(_running(job_id)).values(**values))
    return result.rowcount == 1


def finish(
    conn: Connection,
    job_id: str,
    status: JobStatus,
    *,
    error: JobError | None = None,
    artifacts: Sequence[Artifact] | None = None,
    metrics: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
    phases: Sequence[PhaseTiming] | None = None,
    progress: Progress | None = None,
    from_statuses: Sequence[JobStatus] = (JobStatus.RUNNING,),
    tenant_max_artifact_bytes: int | None = None,
) -> bool:
    """Move a job to a terminal status; False if it was not in ``from_statuses``.

    ``progress`` is the last phase's final count (a succeeded job ends with every file
    of its finalize phase done, not with whatever the last throttled report said).

    With ``tenant_max_artifact_bytes``, a job of a tenant succeeds only if its artifacts
    fit beside the tenant's live ones; else TenantLimitExceeded and nothing is written
    (the caller fails the job and removes its files). Checked under the submit lock, so
    two jobs ending at once cannot both take the last free bytes.

    The job's callback (if any) becomes due and its figures join the totals in the same
    transaction: counted once, never lost."""
    assert status.terminal
    now = utcnow()
    values: dict[str, Any] = {
        "status": status.value,
        "version": NEXT_VERSION,
        "finished_at": now,
        "updated_at": now,
        "error_type": error.type if error else None,
        "error_message": error.message if error else None,
        **due_when_ended(now),
        **_reported(progress, metrics, details, phases),
    }
    if status is JobStatus.SUCCEEDED:
        values["phase"] = Phase.DONE.value
    if artifacts is not None:
        values["artifacts"] = [asdict(a) for a in artifacts]
    result = conn.execute(
        update(jobs_table)
        .where(
            jobs_table.c.id == job_id,
            jobs_table.c.status.in_([s.value for s in from_statuses]),
        )
        .values(**values)
    )
    if result.rowcount != 1:
        return False
    ended = get(conn, job_id)
    if status is JobStatus.SUCCEEDED and tenant_max_artifact_bytes is not None:
        check_artifact_room(conn, ended, tenant_max_artifact_bytes)
    add_totals(conn, totals.ended_figures(ended))
    return True


def request_cancel(conn: Connection, job_id: str, tenant: str | None = None) -> Job:
    """Cancel a queued job at once; flag a running one for its executor to stop."""
    job = get(conn, job_id, tenant)
    if job.status.terminal:
        raise Conflict(f"job {job_id} is already {job.status.value}")
    if job.status is JobStatus.QUEUED and finish(
        conn,
        job_id,
        JobStatus.CANCELLED,
        error=JobError("job_cancelled", "cancelled before it started"),
        from_statuses=(JobStatus.QUEUED,),
    ):
        return get(conn, job_id)
    conn.execute(
        update(jobs_table)
        .where(jobs_table.c.id == job_id)
        .values(cancel_requested=True, updated_at=utcnow(), version=NEXT_VERSION)
    )
    return get(conn, job_id)


def heartbeat(conn: Connection, job_ids: Sequence[str], worker: str) -> list[str]:
    """Mark ``worker``'s running jobs alive; returns those still running for it.

    The worker's timer calls this so that a quiet phase (no progress report) is not taken
    for a dead worker. It is not a change a watcher cares about: ``version`` stays."""
    alive = []
    now = utcnow()
    for job_id in job_ids:
        result = conn.execute(
            update(jobs_table)
            .where(_running(job_id), jobs_table.c.worker == worker)
            .values(heartbeat_at=now)
        )
        if result.rowcount == 1:
            alive.append(job_id)
    return alive


def lock_stale(conn: Connection, job_id: str, stale_before: datetime) -> Job | None:
    """The job if it is still running with a stale heartbeat, row-locked (PostgreSQL) until
    the caller's transaction ends, so that one reaper among many releases it."""
    row = conn.execute(
        select(jobs_table)
        .where(_running(job_id), jobs_table.c.heartbeat_at < stale_before)
        .with_for_update(skip_locked=True)
    ).mappings().first()
    return None if row is None else to_job(row)


def requeue(conn: Connection, job_id: str) -> bool:
    """Put an interrupted running job back in the queue, progress reset."""
    result = conn.execute(
        update(jobs_table)
        .where(_running(job_id))
        .values(
            version=NEXT_VERSION,
            status=JobStatus.QUEUED.value,
            phase=Phase.QUEUED.value,
            progress_done=0,
            progress_total=None,
            worker=None,
            reused_from=None,  # the next attempt settles reuse anew
            updated_at=utcnow(),
        )
    )
    return result.rowcount == 1


def mark_deleted(
    conn: Connection, job_id: str, freed_bytes: int, tenant: str | None = None
) -> Job | None:
    """Record that a finished job's files are removed: no artifacts any more, its
    ``deleted_at`` set and ``artifact_bytes_freed`` in its metrics. The row stays as a
    tombstone (its history and metrics). None if the job is not finished; the job as it is
    if already deleted."""
    job = get(conn, job_id, tenant)
    if not job.status.terminal:
        return None
    if job.deleted_at is not None:
        return job
    now = utcnow()
    marked = conn.execute(
        update(jobs_table)
        .where(jobs_table.c.id == job_id, jobs_table.c.files_deleted_at.is_(None))
        .values(
            artifacts=[],
            files_deleted_at=now,
            metrics={**job.metrics, "artifact_bytes_freed": freed_bytes},
            updated_at=now,
            version=NEXT_VERSION,
        )
    )
    if marked.rowcount != 1:  # another removal marked it meanwhile
        return get(conn, job_id)
    freed: dict[TotalKey, float] = {(totals.FREED, "", ""): float(freed_bytes)}
    if job.status is JobStatus.SUCCEEDED:
        freed[(totals.ARTIFACT_BYTES, job.tenant or "", "")] = -float(totals.artifact_bytes(job))
    add_totals(conn, freed)
    return get(conn, job_id)
