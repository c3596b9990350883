"""Reads of jobs: one job, the jobs that changed, a page, counts and id lists.

Functions on a connection; :class:`service.jobs.store.JobStore` opens it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from sqlalchemy import and_, func, select
from sqlalchemy.engine import Connection

from service.errors import JobNotFound
from service.jobs.model import Job, JobStatus
from service.jobs.store.schema import BY_ID, BY_ID_OF_TENANT, jobs_table, to_job


def get(conn: Connection, job_id: str, tenant: str | None = None) -> Job:
    """The job, or JobNotFound (also when it belongs to another tenant)."""
    query, params = (
        (BY_ID, {"job_id": job_id})
        if tenant is None
        else (BY_ID_OF_TENANT, {"job_id": job_id, "tenant": tenant})
    )
    row = conn.execute(query, params).mappings().first()
    if row is None:
        raise JobNotFound(f"no job {job_id}")
    return to_job(row)


def changed(conn: Connection, known: Mapping[str, int]) -> dict[str, Job | None]:
    """The jobs of ``known`` (id -> version) whose version is no longer the known one, in
    their current state (None: no such job any more).

    One query for the versions, one more for the rows that moved: a watcher of many jobs
    pays for the changes, not for every job at every poll."""
    if not known:
        return {}
    ids = list(known)
    versions: dict[str, int] = {
        job_id: version
        for job_id, version in conn.execute(
            select(jobs_table.c.id, jobs_table.c.version).where(jobs_table.c.id.in_(ids))
        )
    }
    moved = [job_id for job_id in ids if versions.get(job_id) != known[job_id]]
    present = [job_id for job_id in moved if job_id in versions]
    rows = (
        conn.execute(select(jobs_table).where(jobs_table.c.id.in_(present))).mappings().all()
        if present
        else []
    )
    found: dict[str, Job | None] = dict.fromkeys(moved)
    found.update((row["id"], to_job(row)) for row in rows)
    return found


def page(
    conn: Connection,
    status: JobStatus | None = None,
    tenant: str | None = None,
    limit: int = 50,
    before: tuple[datetime, str] | None = None,
) -> list[Job]:
    """Newest first; ``before`` is the (created_at, id) of the last job of the previous page."""
    query = select(jobs_table).order_by(jobs_table.c.created_at.desc(), jobs_table.c.id.desc())
    if status is not None:
        query = query.where(jobs_table.c.status == status.value)
    if tenant is not None:
        query = query.where(jobs_table.c.tenant == tenant)
    if before is not None:
        created, job_id = before
        query = query.where(
            (jobs_table.c.created_at < created)
            | (and_(jobs_table.c.created_at == created, jobs_table.c.id < job_id))
        )
    return [to_job(r) for r in conn.execute(query.limit(limit)).mappings().all()]


def count(conn: Connection, statuses: Sequence[JobStatus], tenant: str | None = None) -> int:
    """How many jobs (of ``tenant``, or of everyone) have one of ``statuses``."""
    query = select(func.count()).select_from(jobs_table).where(
        jobs_table.c.status.in_([s.value for s in statuses])
    )
    if tenant is not None:
        query = query.where(jobs_table.c.tenant == tenant)
    return int(conn.execute(query).scalar_one())


def cancel_requested(conn: Connection, job_ids: Sequence[str]) -> set[str]:
    """Those of ``job_ids`` flagged for cancellation (one query for all of them)."""
    if not job_ids:
        return set()
    query = select(jobs_table.c.id).where(
        jobs_table.c.id.in_(list(job_ids)), jobs_table.c.cancel_requested.is_(True)
    )
    return {r[0] for r in conn.execute(query)}


def ids_with_status(conn: Connection, statuses: Sequence[JobStatus]) -> list[str]:
    query = select(jobs_table.c.id).where(jobs_table.c.status.in_([s.value for s in statuses]))
    return [r[0] for r in conn.execute(query)]


def next_queued(conn: Connection, limit: int) -> list[str]:
    """Oldest queued job ids first (FIFO)."""
    query = (
        select(jobs_table.c.id)
        .where(jobs_table.c.status == JobStatus.QUEUED.value)
        .order_by(jobs_table.c.created_at, jobs_table.c.id)
        .limit(limit)
    )
    return [r[0] for r in conn.execute(query)]


def expired(conn: Connection, finished_before: datetime, limit: int) -> list[str]:
    """Ids of finished jobs that still hold files and ended before ``finished_before``."""
    query = (
        select(jobs_table.c.id)
        .where(
            jobs_table.c.finished_at < finished_before,
            jobs_table.c.files_deleted_at.is_(None),
            jobs_table.c.status.in_([s.value for s in JobStatus if s.terminal]),
        )
        .order_by(jobs_table.c.finished_at)
        .limit(limit)
    )
    return [r[0] for r in conn.execute(query)]


def stale_running(conn: Connection, stale_before: datetime) -> list[str]:
    """Running jobs whose last heartbeat is older than ``stale_before``: their worker died."""
    query = select(jobs_table.c.id).where(
        jobs_table.c.status == JobStatus.RUNNING.value,
        jobs_table.c.heartbeat_at < stale_before,
    )
    return [r[0] for r in conn.execute(query)]
