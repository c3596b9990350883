"""jobs.phases: the phase timeline gets a column of its own, and ``details`` keeps only sections.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

The timeline (``[{"phase", "started_at", "seconds"}, ...]``) was a ``phases`` key of the
``details`` document, and a removed job's ``deleted_at`` a key there too, beside the
``files_deleted_at`` column. Each is now one typed field of the job read from one column: this
revision moves the timeline out of ``details`` into ``phases``, and the removal time into
``files_deleted_at`` where only ``details`` had it (rows removed before revision 0003), in
batches of rows keyed by id.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BATCH = 500

jobs = sa.table(
    "jobs",
    sa.column("id", sa.String),
    sa.column("details", sa.JSON),
    sa.column("phases", sa.JSON),
    sa.column("files_deleted_at", sa.DateTime(timezone=True)),
)


def _batches(conn: sa.Connection, *where: Any) -> Iterator[Sequence[Any]]:
    """The rows matching ``where``, in batches by id (each read before the caller updates it)."""
    last = ""
    while True:
        batch = conn.execute(
            sa.select(jobs.c.id, jobs.c.details, jobs.c.phases, jobs.c.files_deleted_at)
            .where(jobs.c.id > last, *where)
            .order_by(jobs.c.id)
            .limit(BATCH)
        ).all()
        if batch:
            yield batch
        if len(batch) < BATCH:
            return
        last = batch[-1].id


def upgrade() -> None:
    conn = op.get_bind()
    # A database adopted from today's ``create_all`` (stamped 0001) has the column already.
    if "phases" not in {c["name"] for c in sa.inspect(conn).get_columns("jobs")}:
        op.add_column("jobs", sa.Column("phases", sa.JSON, nullable=False, server_default="[]"))
    text = sa.cast(jobs.c.details, sa.Text)
    mentioning = sa.or_(text.like('%"phases"%'), text.like('%"deleted_at"%'))
    for row in (row for batch in _batches(conn, mentioning) for row in batch):
        details = dict(row.details or {})
        if "phases" not in details and "deleted_at" not in details:
            continue
        phases = details.pop("phases", None)
        deleted = details.pop("deleted_at", None)
        values: dict[str, Any] = {"details": details}
        if isinstance(phases, list):
            values["phases"] = phases
        if isinstance(deleted, str) and row.files_deleted_at is None:
            values["files_deleted_at"] = datetime.fromisoformat(deleted)
        conn.execute(jobs.update().where(jobs.c.id == row.id).values(**values))


def downgrade() -> None:
    conn = op.get_bind()
    for row in (row for batch in _batches(conn) for row in batch):
        details = dict(row.details or {})
        if row.phases:
            details["phases"] = row.phases
        if row.files_deleted_at is not None:
            details["deleted_at"] = row.files_deleted_at.isoformat()
        conn.execute(jobs.update().where(jobs.c.id == row.id).values(details=details))
    op.drop_column("jobs", "phases")
