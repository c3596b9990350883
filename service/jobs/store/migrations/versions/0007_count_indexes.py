"""Indexes for the reads that must not grow with the number of jobs kept.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

``ix_jobs_status_phase``: ``/metrics`` counts jobs by status and phase; with this index the
GROUP BY reads the index, not every (JSON-heavy) row. ``ix_jobs_tenant_status``: a submit under
a tenant artifact-bytes limit sums the reservations of the tenant's queued and running jobs;
with this index it reads those few, not every job the tenant ever ran
(bench/metrics_scale.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

INDEXES = {"ix_jobs_status_phase": ["status", "phase"], "ix_jobs_tenant_status": ["tenant", "status"]}


def upgrade() -> None:
    # A database adopted from today's ``create_all`` (stamped 0001) has them already.
    present = {i["name"] for i in sa.inspect(op.get_bind()).get_indexes("jobs")}
    for name, columns in INDEXES.items():
        if name not in present:
            op.create_index(name, "jobs", columns)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, "jobs")
