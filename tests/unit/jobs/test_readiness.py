"""Readiness and event-loop reads are the domain's decisions (JobService), on real databases."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.errors import JobNotFound
from service.jobs.executors.local import LocalExecutor
from service.jobs.service import JobService
from service.jobs.store import JobStore
from tests.fixtures.postgres import fresh_database


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[JobService]:
    settings = Settings(data_dir=tmp_path / "data")
    settings.data_dir.mkdir()
    store = JobStore.from_url(settings.sqlalchemy_url)
    store.create_schema()
    yield JobService(settings=settings, store=store, executor=LocalExecutor(settings, store))
    store.dispose()


def test_a_working_store_and_data_directory_are_ready(jobs: JobService) -> None:
    assert jobs.readiness() == {"database": "ok", "data_dir": "ok"}


def test_an_unreachable_database_is_reported_not_raised(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    # A real PostgreSQL URL on a port nobody listens on: the driver's own refusal.
    store = JobStore.from_url("postgresql+psycopg://postgres@127.0.0.1:9/none?connect_timeout=5")
    try:
        checks = JobService(settings, store, LocalExecutor(settings, store)).readiness()
    finally:
        store.dispose()
    assert checks["database"].startswith("error: ") and checks["data_dir"] == "ok"


def test_a_removed_data_directory_is_not_ready(jobs: JobService) -> None:
    shutil.rmtree(jobs.settings.data_dir)
    assert jobs.readiness()["data_dir"] == "missing"


def _threads_of_a_read_on_the_loop(jobs: JobService, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads the store's ``get`` ran on for one ``get_on_loop`` (of a missing job)."""
    threads: list[str] = []
    get = jobs.store.get

    def recording_get(job_id: str, tenant: str | None = None) -> object:
        threads.append(threading.current_thread().name)
        return get(job_id, tenant)

    monkeypatch.setattr(jobs.store, "get", recording_get)
    with pytest.raises(JobNotFound):
        asyncio.run(jobs.get_on_loop("no-such-job"))
    return threads


def test_sqlite_reads_stay_on_the_event_loop_thread(
    jobs: JobService, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _threads_of_a_read_on_the_loop(jobs, monkeypatch) == [threading.main_thread().name]


def test_postgresql_reads_leave_the_event_loop_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path)
    with fresh_database() as url:
        store = JobStore.from_url(url)
        try:
            store.create_schema()
            jobs = JobService(settings, store, LocalExecutor(settings, store))
            threads = _threads_of_a_read_on_the_loop(jobs, monkeypatch)
        finally:
            store.dispose()
    assert len(threads) == 1 and threads != [threading.main_thread().name]
