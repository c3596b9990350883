"""The alembic migrations build exactly the table store/schema.py defines, on SQLite and PostgreSQL,
and adopt a database made before migrations existed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, Table, inspect, text

from service.jobs.store import JobStore, metadata, utcnow
from service.jobs.store.migrations import current_revision, upgrade
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


def test_the_timeline_and_the_removal_time_move_out_of_details_into_their_columns(
    url: str,
) -> None:
    """A store at revision 0007 kept both in ``details`` (and a job removed before revision
    0003 had no ``files_deleted_at``): upgrading moves them, and ``details`` keeps the rest."""
    with ExitStack() as stack:
        store = JobStore.from_url(url)
        stack.callback(store.dispose)
        upgrade(store.engine, "0007")
        now = utcnow()
        timeline = [{"phase": "download", "started_at": now.isoformat(), "seconds": 0.5},
                    {"phase": "export", "started_at": now.isoformat(), "seconds": 2.0,
                     "peak_rss_bytes": 7}]
        removed = (now - timedelta(days=1)).isoformat()
        with store.engine.begin() as conn:
            jobs = Table("jobs", MetaData(), autoload_with=conn)  # the 0007 shape
            base = {"spec": {}, "status": "succeeded", "phase": "done", "created_at": now,
                    "finished_at": now - timedelta(days=2), "updated_at": now, "progress_done": 0, "progress_unit": "bytes",
                    "attempts": 1, "cancel_requested": False, "version": 3, "artifacts": [],
                    "metrics": {}}
            conn.execute(jobs.insert(), [
                {**base, "id": "ran", "details": {"phases": timeline, "model": {"a": 1}}},
                {**base, "id": "old-tombstone",
                 "details": {"phases": timeline[:1], "deleted_at": removed}},
                {**base, "id": "tombstone", "files_deleted_at": now,
                 "details": {"deleted_at": now.isoformat()}},
                {**base, "id": "plain", "details": {"source": {"uri": "file:///m"}}},
            ])
        store.create_schema()

        ran = store.get("ran")
        assert [e.to_json() for e in ran.phases] == timeline and ran.details == {"model": {"a": 1}}
        assert ran.deleted_at is None
        old = store.get("old-tombstone")
        assert old.deleted_at is not None and old.deleted_at.isoformat() == removed
        assert [e.to_json() for e in old.phases] == timeline[:1] and old.details == {}
        tombstone = store.get("tombstone")
        assert tombstone.deleted_at == now and tombstone.details == {}
        assert store.get("plain").details == {"source": {"uri": "file:///m"}}
        # retention sees the old tombstone as removed (its column filled), the others not
        assert set(store.expired(now, 10)) == {"ran", "plain"}


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
