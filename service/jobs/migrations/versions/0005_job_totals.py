"""job_totals (what ended jobs add up to) and jobs.reserved_bytes (a queued job's estimate).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

``job_totals`` lets ``/metrics`` and the tenant artifact-bytes limit read a few hundred rows
instead of every job (see ``service/jobs/totals.py``); this revision fills it from the jobs
already in the store, once. ``reserved_bytes`` is what a queued or running job is expected to
write, counted against its tenant's artifact-bytes limit until it ends.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_jobs = sa.table(
    "jobs",
    sa.column("id", sa.String), sa.column("status", sa.String), sa.column("phase", sa.String),
    sa.column("tenant", sa.String), sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("started_at", sa.DateTime(timezone=True)),
    sa.column("finished_at", sa.DateTime(timezone=True)),
    sa.column("artifacts", sa.JSON), sa.column("metrics", sa.JSON), sa.column("details", sa.JSON),
)


def _aware(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _backfill(conn: sa.Connection, totals_table: sa.Table) -> None:
    """Add every ended job's figures, as :func:`service.jobs.totals.ended_figures` counts them
    today (the function is pure: it reads a job, not the live table)."""
    from service.jobs.model import Artifact, Job, JobStatus, Phase
    from service.jobs.totals import ended_figures, merged

    ended = [s.value for s in JobStatus if s.terminal]
    figures: list[dict[Any, float]] = []
    query = sa.select(_jobs).where(_jobs.c.status.in_(ended)).execution_options(yield_per=500)
    for row in conn.execute(query).mappings():
        job = Job(
            id=row["id"], status=JobStatus(row["status"]), phase=Phase(row["phase"]), spec={},
            created_at=_aware(row["created_at"]) or datetime.now(UTC),
            started_at=_aware(row["started_at"]), finished_at=_aware(row["finished_at"]),
            artifacts=tuple(Artifact(**a) for a in row["artifacts"] or []),
            metrics=dict(row["metrics"] or {}), details=dict(row["details"] or {}),
            tenant=row["tenant"],
        )
        figures.append(ended_figures(job))
        if len(figures) >= 500:
            figures = [merged(figures)]
    rows = [
        {"name": n, "label": label, "bucket": b, "value": v}
        for (n, label, b), v in sorted(merged(figures).items())
        if v
    ]
    freed = sa.select(_jobs.c.metrics).where(_jobs.c.status.in_(ended))
    total_freed = 0.0
    for (metrics,) in conn.execute(freed):
        value = (metrics or {}).get("artifact_bytes_freed")
        if isinstance(value, int | float):
            total_freed += float(value)
    if total_freed:
        rows.append({"name": "artifact_bytes_freed", "label": "", "bucket": "",
                     "value": total_freed})
    if rows:
        op.bulk_insert(totals_table, rows)


def upgrade() -> None:
    # A database adopted from today's ``create_all`` (stamped 0001) has both already, and its
    # totals were kept by the store from the start: nothing to fill then.
    found = sa.inspect(op.get_bind())
    if "reserved_bytes" not in {c["name"] for c in found.get_columns("jobs")}:
        op.add_column(
            "jobs",
            sa.Column("reserved_bytes", sa.BigInteger, nullable=False, server_default="0"),
        )
    if found.has_table("job_totals"):
        return
    totals_table = op.create_table(
        "job_totals",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("label", sa.String(64), primary_key=True),
        sa.Column("bucket", sa.String(16), primary_key=True),
        sa.Column("value", sa.Float(precision=53), nullable=False),
    )
    _backfill(op.get_bind(), totals_table)


def downgrade() -> None:
    op.drop_column("jobs", "reserved_bytes")
    op.drop_table("job_totals")
