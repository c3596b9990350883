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


# What an ended job added to the totals when this revision was written, copied here rather than
# imported (a revision must not change when live code does: ``service.jobs.totals`` has since
# read the timeline from ``Job.phases``, a column revision 0008 fills, not from ``details``).
_ENDED = ("succeeded", "failed", "cancelled")
_PHASE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                  3600.0, 7200.0, 21600.0, 86400.0)  # fmt: skip
_BYTE_COUNTERS = ("bytes_read", "bytes_written", "bytes_downloaded")
"""The byte metrics a job adds when it ends (``artifact_bytes_freed`` is added apart)."""

_Key = tuple[str, str, str]


def _aware(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start and end else None


def _observe(out: dict[_Key, float], name: str, label: str, value: float) -> None:
    bound = next((b for b in _PHASE_BUCKETS if value <= b), None)
    bucket = "+Inf" if bound is None else str(bound)
    for key, add in (((name, label, bucket), 1.0), ((name, label, "sum"), value)):
        out[key] = out.get(key, 0.0) + add


def _ended_figures(row: Any) -> dict[_Key, float]:
    """What one ended job's row adds: its wait, byte counts and cache use, its phases (the
    ``phases`` list of ``details`` at this revision), its run time by status, and the live
    bytes of a succeeded job whose files are still there (no ``deleted_at`` in ``details``)."""
    out: dict[_Key, float] = {}
    started, finished = _aware(row["started_at"]), _aware(row["finished_at"])
    wait = _seconds(_aware(row["created_at"]) or datetime.now(UTC), started)
    if wait is not None:
        _observe(out, "wait_seconds", "", wait)
    metrics, details = dict(row["metrics"] or {}), dict(row["details"] or {})
    for key in _BYTE_COUNTERS:
        value = metrics.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[(key, "", "")] = float(value)
    hit = metrics.get("cache_hit")
    if isinstance(hit, bool):
        out[("cache_hits" if hit else "cache_misses", "", "")] = 1.0
    phases = details.get("phases")
    for entry in phases if isinstance(phases, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("seconds"), int | float):
            _observe(out, "phase_seconds", str(entry.get("phase")), float(entry["seconds"]))
    run = _seconds(started, finished)
    if run is not None:
        _observe(out, "run_seconds", row["status"], run)
    if row["status"] == "succeeded" and "deleted_at" not in details:
        size = sum(a["size"] for a in row["artifacts"] or [])
        out[("artifact_bytes", row["tenant"] or "", "")] = float(size)
    return out


def _backfill(conn: sa.Connection, totals_table: sa.Table) -> None:
    """Add every ended job's figures (:func:`_ended_figures`) and the bytes of removed files."""
    totals: dict[_Key, float] = {}
    query = sa.select(_jobs).where(_jobs.c.status.in_(_ENDED)).execution_options(yield_per=500)
    for row in conn.execute(query).mappings():
        for key, figure in _ended_figures(row).items():
            totals[key] = totals.get(key, 0.0) + figure
    rows = [
        {"name": n, "label": label, "bucket": b, "value": v}
        for (n, label, b), v in sorted(totals.items())
        if v
    ]
    freed = sa.select(_jobs.c.metrics).where(_jobs.c.status.in_(_ENDED))
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
