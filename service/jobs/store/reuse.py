"""The SQL of result reuse (the feature: :mod:`service.jobs.reuse`): settling, for a running
job, whether it reuses an identical job's artifacts, waits for it, or computes them."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import and_, select, update
from sqlalchemy.engine import Connection

from service.jobs.model import Job, JobStatus
from service.jobs.store.schema import NEXT_VERSION, jobs_table, lock_writes, to_job, utcnow


class ReuseAction(StrEnum):
    REUSE = "reuse"
    """A succeeded job with the same key still holds its artifacts: share them."""
    WAIT = "wait"
    """Another job with the same key is running: wait for its outcome, then settle again."""
    COMPUTE = "compute"
    """Nobody has or is computing the result: this job computes it (and others may wait)."""


@dataclass(frozen=True)
class ReuseDecision:
    action: ReuseAction
    other: Job | None = None
    """The job reused (REUSE) or waited for (WAIT)."""


def settle_reuse(
    conn: Connection,
    job_id: str,
    key: str,
    *,
    reuse: bool = True,
    exclude: Collection[str] = (),
) -> ReuseDecision:
    """Decide, for running job ``job_id`` whose result has key ``key``, whether it reuses a
    succeeded job's artifacts, waits for a running job computing the same result, or
    computes it itself (opting out with ``reuse=False`` always computes).

    The decision and its record (``reuse_key``, and ``reused_from`` when reusing) are one
    transaction (``conn``'s) under a lock on the key (taken first, see
    :func:`service.jobs.store.schema.lock_writes`), so of two identical jobs settling at
    once, on any host, exactly one computes and the other sees it running. Only *running*
    jobs are waited for: one re-queued or stuck in the queue is never waited for by a job
    holding a worker slot, so waiting never deadlocks a full pool. ``exclude``: jobs not
    to reuse (their files turned out to be gone)."""
    # 60 bits of the (hex) key: a signed bigint, distinct from the submit lock's key.
    lock_writes(conn, int(key[:15], 16))
    if reuse:
        same = and_(jobs_table.c.reuse_key == key, jobs_table.c.id.not_in([job_id, *exclude]))
        row = conn.execute(
            select(jobs_table)
            .where(
                same,
                jobs_table.c.status == JobStatus.SUCCEEDED.value,
                jobs_table.c.files_deleted_at.is_(None),
            )
            .order_by(jobs_table.c.finished_at.desc(), jobs_table.c.id)
            .limit(1)
        ).mappings().first()
        if row is not None:
            _set_reuse(conn, job_id, key, reused_from=row["id"])
            return ReuseDecision(ReuseAction.REUSE, to_job(row))
        row = conn.execute(
            select(jobs_table)
            .where(same, jobs_table.c.status == JobStatus.RUNNING.value)
            .order_by(jobs_table.c.started_at, jobs_table.c.id)
            .limit(1)
        ).mappings().first()
        if row is not None:
            return ReuseDecision(ReuseAction.WAIT, to_job(row))
    _set_reuse(conn, job_id, key, reused_from=None)
    return ReuseDecision(ReuseAction.COMPUTE)


def _set_reuse(conn: Connection, job_id: str, key: str, reused_from: str | None) -> None:
    conn.execute(
        update(jobs_table)
        .where(jobs_table.c.id == job_id)
        .values(reuse_key=key, reused_from=reused_from, updated_at=utcnow(), version=NEXT_VERSION)
    )
