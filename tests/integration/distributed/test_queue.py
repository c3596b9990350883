"""The distributed executor's bookkeeping against a real PostgreSQL: the job row and its
procrastinate job change together (submit, cancel, reaping a job whose worker died), and
what cannot work is refused up front."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import procrastinate
import pytest
from procrastinate.exceptions import AlreadyEnqueued
from sqlalchemy import text

from service.config import Settings
from service.errors import ConfigurationError, QueueFull, SecretNotForwardable
from service.jobs.executors import executor_for
from service.jobs.executors.distributed import JobQueue, ProcrastinateExecutor, libpq_url
from service.jobs.model import Job, JobStatus, Phase
from service.jobs.recovery import MAX_ATTEMPTS
from service.jobs.store import JobStore, utcnow
from service.jobs.worker import WorkerRuntime
from tests.fixtures.postgres import fresh_database

pytestmark = pytest.mark.postgres


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    with fresh_database() as url:
        yield Settings(
            data_dir=tmp_path, database_url=url, executor="procrastinate", max_queued=5,
            heartbeat_timeout_seconds=30,
        )


@pytest.fixture
def store(settings: Settings) -> Iterator[JobStore]:
    store = JobStore.from_url(settings.sqlalchemy_url)
    store.create_schema()
    yield store
    store.dispose()


@pytest.fixture
def executor(settings: Settings, store: JobStore) -> ProcrastinateExecutor:
    executor = executor_for(settings, store)
    assert isinstance(executor, ProcrastinateExecutor)
    return executor


def new_job() -> Job:
    return Job(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        phase=Phase.QUEUED,
        spec={"source": "file:///x", "exports": [{"format": "safetensors"}]},
        created_at=utcnow(),
    )


def queue_jobs(store: JobStore, job_id: str) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status, abort_requested, args FROM procrastinate_jobs "
                 "WHERE lock = :lock ORDER BY id"),
            {"lock": job_id},
        ).mappings().all()
    return [dict(r) for r in rows]


def start_running(store: JobStore, job_id: str, worker: str = "dead-host:1") -> None:
    """What a worker does when it takes the job: procrastinate's job doing, the row claimed."""
    assert store.claim(job_id, worker) is not None
    with store.transaction() as conn:
        conn.execute(
            text("UPDATE procrastinate_jobs SET status = 'doing' WHERE lock = :lock"),
            {"lock": job_id},
        )


def silence(store: JobStore, job_id: str, seconds: float) -> None:
    with store.transaction() as conn:
        conn.execute(
            text("UPDATE jobs SET heartbeat_at = :at WHERE id = :id"),
            {"at": utcnow() - timedelta(seconds=seconds), "id": job_id},
        )


def reap(settings: Settings, store: JobStore) -> int:
    """One reaping round of a live worker, with procrastinate's async manager as in a worker."""

    async def go() -> int:
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(conninfo=libpq_url(settings.sqlalchemy_url))
        )
        async with app.open_async():
            runtime = WorkerRuntime(settings=settings, store=store, name="live-host:2")
            return await runtime.reap(app.job_manager)

    return asyncio.run(go())


def test_submit_writes_the_row_and_one_queue_job(
    executor: ProcrastinateExecutor, store: JobStore
) -> None:
    job = executor.submit(new_job(), {})
    assert store.get(job.id) == job
    [entry] = queue_jobs(store, job.id)
    assert entry["status"] == "todo" and entry["args"] == {"job_id": job.id}


def test_a_refused_queue_insert_leaves_no_row(
    executor: ProcrastinateExecutor, store: JobStore
) -> None:
    job = new_job()
    with store.transaction() as conn:  # a queue job already holds this job's queueing lock
        JobQueue().enqueue(conn, job.id)
    with pytest.raises(AlreadyEnqueued):
        executor.submit(job, {})
    assert store.ids_with_status([JobStatus.QUEUED]) == []


def test_back_pressure_leaves_no_queue_job(
    executor: ProcrastinateExecutor, store: JobStore, settings: Settings
) -> None:
    for _ in range(settings.max_queued):
        executor.submit(new_job(), {})
    refused = new_job()
    with pytest.raises(QueueFull):
        executor.submit(refused, {})
    assert queue_jobs(store, refused.id) == []


def test_a_per_job_secret_is_refused_before_anything_is_written(
    executor: ProcrastinateExecutor, store: JobStore
) -> None:
    job = new_job()
    with pytest.raises(SecretNotForwardable):
        executor.submit(job, {"hf_token": "hf_x"})
    assert store.ids_with_status([JobStatus.QUEUED]) == [] and queue_jobs(store, job.id) == []


def test_cancelling_a_queued_job_cancels_its_queue_job(
    executor: ProcrastinateExecutor, store: JobStore
) -> None:
    job = executor.submit(new_job(), {})
    assert executor.cancel(job.id).status is JobStatus.CANCELLED
    assert [e["status"] for e in queue_jobs(store, job.id)] == ["cancelled"]


def test_cancelling_a_running_job_flags_the_row_and_asks_procrastinate_to_abort(
    executor: ProcrastinateExecutor, store: JobStore
) -> None:
    job = executor.submit(new_job(), {})
    start_running(store, job.id)
    flagged = executor.cancel(job.id)
    assert flagged.status is JobStatus.RUNNING and flagged.cancel_requested
    [entry] = queue_jobs(store, job.id)
    assert entry["status"] == "doing" and entry["abort_requested"]


def test_a_job_of_a_silent_worker_is_requeued_and_delivered_again(
    executor: ProcrastinateExecutor, store: JobStore, settings: Settings
) -> None:
    lost, alive = executor.submit(new_job(), {}), executor.submit(new_job(), {})
    start_running(store, lost.id)
    start_running(store, alive.id)
    silence(store, lost.id, settings.heartbeat_timeout_seconds + 5)
    silence(store, alive.id, settings.heartbeat_timeout_seconds - 10)
    assert reap(settings, store) == 1
    again = store.get(lost.id)
    assert again.status is JobStatus.QUEUED and again.attempts == 1 and again.worker is None
    assert [e["status"] for e in queue_jobs(store, lost.id)] == ["todo"]
    assert store.get(alive.id).status is JobStatus.RUNNING
    assert [e["status"] for e in queue_jobs(store, alive.id)] == ["doing"]
    assert reap(settings, store) == 0  # released once


def test_a_job_that_lost_its_worker_too_often_fails(
    executor: ProcrastinateExecutor, store: JobStore, settings: Settings
) -> None:
    job = executor.submit(new_job(), {})
    for attempt in range(MAX_ATTEMPTS):
        start_running(store, job.id, worker=f"dead-host:{attempt}")
        silence(store, job.id, settings.heartbeat_timeout_seconds + 5)
        assert reap(settings, store) == 1
    failed = store.get(job.id)
    assert failed.status is JobStatus.FAILED and failed.error is not None
    assert failed.error.type == "job_interrupted"


def test_the_procrastinate_executor_needs_postgresql(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, executor="procrastinate")
    with pytest.raises(ConfigurationError):
        executor_for(settings, JobStore.from_url(settings.sqlalchemy_url))
