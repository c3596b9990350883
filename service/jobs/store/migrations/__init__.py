"""The job store's schema history: alembic migrations, run programmatically at start-up.

``store/schema.py`` holds the one definition of the tables that the code uses; the revisions
under ``versions/`` are their history, frozen as written (a revision never imports the live table,
or re-running an old revision would create today's shape). ``tests/unit/jobs/test_migrations.py``
fails when the two drift apart, so a change of the table comes with a new revision:
``alembic -x url=sqlite:///scratch.db revision --autogenerate -m "..."`` from this directory's
parent, or by hand.

On PostgreSQL a second revision installs procrastinate's schema (its queue tables), so the
distributed executor needs no separate ``procrastinate schema --apply`` step.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, inspect
from sqlalchemy.engine import Connection

SCRIPT_LOCATION = Path(__file__).parent
BASELINE = "0001"
"""The revision equal to what ``metadata.create_all`` made before migrations existed."""

_PG_LOCK_KEY = 0x6D6F64656C707270
"""pg_advisory_xact_lock key ("modelprp"): start-ups of API and workers migrate one at a time."""


def alembic_config(connection: Connection) -> Config:
    """An alembic configuration without an ini file, bound to ``connection``."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.attributes["connection"] = connection
    return config


@contextmanager
def _sqlite_file_lock(engine: Engine) -> Iterator[None]:
    """SQLite has no advisory locks: a lock file next to the database serializes start-ups."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        yield
        return
    lock_path = Path(database).with_name(Path(database).name + ".migrate.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database to ``revision`` in one transaction, one process at a time.

    A database made by the former ``create_all`` (a ``jobs`` table, no ``alembic_version``) is
    first stamped with the baseline, then upgraded like any other."""
    with _sqlite_file_lock(engine), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY})")
        config = alembic_config(conn)
        tables = inspect(conn)
        if tables.has_table("jobs") and not tables.has_table("alembic_version"):
            command.stamp(config, BASELINE)
        command.upgrade(config, revision)


def current_revision(connection: Connection) -> str | None:
    """The revision the database is at (None before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()
