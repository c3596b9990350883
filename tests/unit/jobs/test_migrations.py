"""The alembic migrations build exactly the table store/schema.py defines, on SQLite and PostgreSQL,
and adopt a database made before migrations existed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from service.jobs.migrations import current_revision
from service.jobs.store import JobStore, metadata
from tests.fixtures.postgres import fresh_database
from tests.unit.jobs.test_store import new_job


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'jobs.db'}"
    else:
        with fresh_database() as pg_url:
            yield pg_url


def test_migrated_schema_is_the_table_store_py_defines(url: str) -> None:
    store = JobStore.from_url(url)
    try:
        store.create_schema()
        with store.engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_name": lambda name, type_, _parent: (
                        type_ != "table" or name in metadata.tables
                    )
                },
            )
            assert compare_metadata(context, metadata) == []
            assert current_revision(conn) is not None
    finally:
        store.dispose()


def test_migrating_twice_changes_nothing(url: str) -> None:
    with ExitStack() as stack:
        store = JobStore.from_url(url)
        stack.callback(store.dispose)
        store.create_schema()
        job = store.create(new_job())
        store.create_schema()
        assert store.get(job.id) == job


def test_a_database_made_by_create_all_is_adopted_with_its_rows(url: str) -> None:
    store = JobStore.from_url(url)
    try:
        metadata.create_all(store.engine)  # what start-up did before migrations
        job = store.create(new_job())
        store.create_schema()
        assert store.get(job.id) == job
        with store.engine.connect() as conn:
            assert current_revision(conn) is not None
    finally:
        store.dispose()


@pytest.mark.postgres
def test_postgresql_gets_procrastinates_queue_schema() -> None:
    with fresh_database() as pg_url:
        store = JobStore.from_url(pg_url)
        try:
            store.create_schema()
            with store.engine.connect() as conn:
                names = set(inspect(conn).get_table_names())
                assert {"jobs", "procrastinate_jobs", "procrastinate_workers"} <= names
                assert conn.execute(text("SELECT count(*) FROM procrastinate_jobs")).scalar() == 0
        finally:
            store.dispose()
