"""The local pool's dispatcher: it acts when told (submit, cancel) or when a job process ends,
and sees what only the store knows (a cancel flagged by another process) at its poll."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs.executors import local
from service.jobs.executors.local import LocalExecutor
from service.jobs.model import Job, JobStatus
from service.jobs.store import JobStore
from tests.fixtures.waiting import eventually
from tests.unit.jobs.test_store import new_job

NEVER = 3600.0
"""A poll interval no test waits for: whatever happens sooner was not the poll's doing."""


def sleeper(seconds: float) -> Callable[[str, Settings, dict[str, str]], BaseProcess]:
    """A stand-in for the job process: sleeps, then exits without reporting (a crash)."""

    def spawn(job_id: str, settings: Settings, secrets: dict[str, str]) -> BaseProcess:
        process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(seconds,))
        process.start()
        return process

    return spawn


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    store = JobStore.from_url(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.create_schema()
    yield store
    store.dispose()


@pytest.fixture(autouse=True)
def no_forkserver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "warm_up", lambda: None)


@contextmanager
def running_pool(store: JobStore, tmp_path: Path, poll_seconds: float) -> Iterator[LocalExecutor]:
    """A started one-slot pool, stopped on exit."""
    executor = LocalExecutor(Settings(data_dir=tmp_path, workers=1), store, poll_seconds)
    executor.start()
    try:
        yield executor
    finally:
        executor.stop()


def wait_for_status(store: JobStore, job: Job, status: JobStatus, within: float) -> float:
    """Seconds until the job reached ``status``; fails after ``within``."""
    started = time.monotonic()
    while (current := store.get(job.id).status) is not status:
        assert time.monotonic() - started < within, f"job still {current.value}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_submitted_job_starts_at_once_and_its_end_is_seen_at_once(
    store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "spawn_job_process", sleeper(0.2))
    with running_pool(store, tmp_path, poll_seconds=NEVER) as executor:
        job = executor.submit(new_job(), {})
        wait_for_status(store, job, JobStatus.FAILED, within=30)
        error = store.get(job.id).error
        assert error is not None and error.type == "worker_crashed"
        # the dispatcher forgets the process just after writing its end: wait, with a deadline
        eventually(lambda: executor.running_ids == [], what="the pool forgetting the job",
                   timeout=5)


def test_a_cancel_through_this_pool_is_applied_at_once(
    store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "spawn_job_process", sleeper(NEVER))
    with running_pool(store, tmp_path, poll_seconds=NEVER) as executor:
        job = executor.submit(new_job(), {})
        wait_for_status(store, job, JobStatus.RUNNING, within=30)
        while not executor.running_ids:
            time.sleep(0.01)
        executor.cancel(job.id)
        wait_for_status(store, job, JobStatus.CANCELLED, within=30)
        # the dispatcher forgets the process just after writing its end: wait, with a deadline
        eventually(lambda: executor.running_ids == [], what="the pool forgetting the job",
                   timeout=5)


def test_a_cancel_flagged_in_the_store_by_another_process_is_seen_at_the_poll(
    store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "spawn_job_process", sleeper(NEVER))
    with running_pool(store, tmp_path, poll_seconds=0.2) as executor:
        job = executor.submit(new_job(), {})
        wait_for_status(store, job, JobStatus.RUNNING, within=30)
        while not executor.running_ids:
            time.sleep(0.01)
        store.request_cancel(job.id)  # as another API process on the same store would
        wait_for_status(store, job, JobStatus.CANCELLED, within=30)
