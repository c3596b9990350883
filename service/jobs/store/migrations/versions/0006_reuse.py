"""jobs.reuse_key and jobs.reused_from: result reuse.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

``reuse_key`` is the sha256 of a job's resolved source identity and recipe
(:mod:`service.jobs.reuse`), set when the job settles what to do with it; an indexed column,
not a key of ``details``, because every job that may reuse looks it up inside its settling
transaction. ``reused_from`` names the job whose artifacts a job shares (the ``reused_from`` of
the job JSON).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A database adopted from ``create_all`` (stamped 0001) may already have them.
    jobs = sa.inspect(op.get_bind())
    columns = {c["name"] for c in jobs.get_columns("jobs")}
    if "reuse_key" not in columns:
        op.add_column("jobs", sa.Column("reuse_key", sa.String(64), nullable=True))
    if "reused_from" not in columns:
        op.add_column("jobs", sa.Column("reused_from", sa.String(36), nullable=True))
    if "ix_jobs_reuse_key" not in {i["name"] for i in jobs.get_indexes("jobs")}:
        op.create_index("ix_jobs_reuse_key", "jobs", ["reuse_key"])


def downgrade() -> None:
    op.drop_index("ix_jobs_reuse_key", "jobs")
    op.drop_column("jobs", "reused_from")
    op.drop_column("jobs", "reuse_key")
