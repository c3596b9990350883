"""procrastinate's queue schema, on PostgreSQL only (SQLite runs the local pool alone).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

This installs the schema of the procrastinate release pinned when it was written (3.10). A later
procrastinate upgrade ships SQL migrations (``procrastinate/sql/migrations``): each becomes a new
revision here that executes that file, as procrastinate's docs recommend for projects that own
their migrations. A database where someone already applied the schema is left alone.
"""

from __future__ import annotations

from alembic import op
from procrastinate.schema import SchemaManager

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    if bind.exec_driver_sql("SELECT to_regclass('procrastinate_jobs')").scalar() is not None:
        return
    # psycopg parses no placeholders when no parameters are given: the SQL goes as written.
    bind.connection.driver_connection.execute(SchemaManager.get_schema())  # type: ignore[union-attr]


def downgrade() -> None:
    raise NotImplementedError("procrastinate's schema is not removed by a downgrade")
