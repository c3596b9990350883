"""jobs.files_deleted_at: when a finished job's artifacts and work files were removed.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Set by ``DELETE /v1/jobs/{id}`` on a finished job and by retention (``MODELPREP_ARTIFACT_TTL``);
the row stays as a tombstone. A column rather than a key of ``details`` so that retention finds
the jobs still holding files with an indexed query, however many tombstones there are.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A database adopted from ``create_all`` (stamped 0001) may already have both.
    jobs = sa.inspect(op.get_bind())
    if "files_deleted_at" not in {c["name"] for c in jobs.get_columns("jobs")}:
        op.add_column(
            "jobs", sa.Column("files_deleted_at", sa.DateTime(timezone=True), nullable=True)
        )
    if "ix_jobs_finished_at" not in {i["name"] for i in jobs.get_indexes("jobs")}:
        op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", "jobs")
    op.drop_column("jobs", "files_deleted_at")
