"""The SQL of the running totals (``job_totals``; what goes in them: :mod:`service.jobs.totals`).

Figures are added in the transaction of the write that produces them (a job ending, its files
removed, a callback attempt recorded), so they are counted once and never lost."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from service.jobs import totals
from service.jobs.model import JobStatus
from service.jobs.store.schema import job_totals, jobs_table, to_job
from service.jobs.totals import TotalKey


def add_totals(conn: Connection, figures: Mapping[TotalKey, float]) -> None:
    """Add ``figures`` to ``job_totals`` within the caller's transaction (an upsert per key,
    in key order, so that two transactions adding to the same rows never deadlock)."""
    rows = [
        {"name": name, "label": label, "bucket": bucket, "value": value}
        for (name, label, bucket), value in sorted(figures.items())
        if value
    ]
    if not rows:
        return
    insert = (
        postgresql_insert(job_totals)
        if conn.dialect.name == "postgresql"
        else sqlite_insert(job_totals)
    )
    conn.execute(
        insert.on_conflict_do_update(
            index_elements=[job_totals.c.name, job_totals.c.label, job_totals.c.bucket],
            set_={"value": job_totals.c.value + insert.excluded.value},
        ),
        rows,
    )


def statistics(
    snapshot: Connection,
) -> tuple[dict[tuple[str, str], int], dict[TotalKey, float]]:
    """(jobs by (status, phase), totals) for ``/metrics``; ``snapshot`` must see one state of
    the database (see ``JobStore.statistics``).

    The totals are those of ended jobs (``job_totals``) plus what running jobs have
    reported so far. Bounded work whatever the number of jobs: a GROUP BY, the totals
    table (a few hundred rows) and the running jobs' rows (as many as the workers run)."""
    states = {
        (status, phase): int(count)
        for status, phase, count in snapshot.execute(
            select(jobs_table.c.status, jobs_table.c.phase, func.count())
            .group_by(jobs_table.c.status, jobs_table.c.phase)
        )
    }
    stored = {
        (name, label, bucket): float(value)
        for name, label, bucket, value in snapshot.execute(select(job_totals))
    }
    running = snapshot.execute(
        select(jobs_table).where(jobs_table.c.status == JobStatus.RUNNING.value)
    ).mappings().all()
    return states, totals.merged(
        [stored, *(totals.running_figures(to_job(row)) for row in running)]
    )


def live_artifact_bytes(tenant: str | None = None) -> Select[Any]:
    """The select of :func:`artifact_bytes` (a scalar), to nest in a larger statement."""
    query = select(func.coalesce(func.sum(job_totals.c.value), 0.0)).where(
        job_totals.c.name == totals.ARTIFACT_BYTES
    )
    return query if tenant is None else query.where(job_totals.c.label == tenant)


def artifact_bytes(conn: Connection, tenant: str | None = None) -> int:
    """Bytes of the artifacts of succeeded jobs whose files are still there (of ``tenant``,
    or of everyone); one read of ``job_totals``."""
    return round(float(conn.execute(live_artifact_bytes(tenant)).scalar_one()))
