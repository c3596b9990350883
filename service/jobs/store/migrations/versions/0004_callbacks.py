"""jobs.callback_*: delivery state of a job's completion callback.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

A job submitted with ``"callback": {"url": ...}`` is POSTed to that URL once it ends
(service/jobs/callbacks.py). The delivery state lives on the job's row so that it survives a
restart and any API process or worker can deliver it: ``callback_state`` (waiting, pending,
delivered, failed), attempts, last answer, and ``callback_next_at``, the time the next attempt
is due, indexed and set only while one is due, so that deliverers find due callbacks with an
indexed range query however many jobs the store holds.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A database adopted from ``create_all`` (stamped 0001) may already have them all.
    jobs = sa.inspect(op.get_bind())
    present = {c["name"] for c in jobs.get_columns("jobs")}
    columns: list[sa.Column[object]] = [
        sa.Column("callback_state", sa.String(16), nullable=True),
        sa.Column("callback_attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("callback_next_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("callback_last_code", sa.Integer(), nullable=True),
        sa.Column("callback_last_error", sa.Text(), nullable=True),
        sa.Column("callback_delivered_at", sa.DateTime(timezone=True), nullable=True),
    ]
    for column in columns:
        if column.name not in present:
            op.add_column("jobs", column)
    if "ix_jobs_callback_next_at" not in {i["name"] for i in jobs.get_indexes("jobs")}:
        op.create_index("ix_jobs_callback_next_at", "jobs", ["callback_next_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_callback_next_at", "jobs")
    for column in ("callback_delivered_at", "callback_last_error", "callback_last_code",
                   "callback_next_at", "callback_attempts", "callback_state"):
        op.drop_column("jobs", column)
