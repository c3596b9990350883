"""Settling a job process that ended without a result, as both executors do."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs.executors.process import _FORKSERVER, settle_exited
from service.jobs.model import JobStatus
from service.jobs.store import JobStore
from tests.unit.jobs.test_store import new_job


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    store = JobStore.from_url(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.create_schema()
    return store


def exited(code: int) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=os._exit, args=(code,))
    process.start()
    process.join()
    return process


def test_a_process_that_left_its_job_running_crashed(store: JobStore, tmp_path: Path) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w1")
    settle_exited(store, Settings(data_dir=tmp_path), job.id, exited(3), worker="w1")
    failed = store.get(job.id)
    assert failed.status is JobStatus.FAILED and failed.error is not None
    assert failed.error.type == "worker_crashed" and "code 3" in failed.error.message


def test_a_job_handed_to_another_worker_is_not_touched(store: JobStore, tmp_path: Path) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w2")
    settle_exited(store, Settings(data_dir=tmp_path), job.id, exited(1), worker="w1")
    assert store.get(job.id).status is JobStatus.RUNNING


def _exit_with_frozen_heap_size() -> None:
    """Job-process stand-in: reports (in thousands, as an exit code) how many objects it
    inherited frozen."""
    sys.exit(min(255, gc.get_freeze_count() // 1000))


def test_job_processes_inherit_the_preloaded_heap_frozen() -> None:
    """Unfrozen, the first full collection in every job walked torch's and transformers'
    objects (0.3 s) and copied their pages into the job; frozen, it walks what the job made."""
    process = _FORKSERVER.Process(target=_exit_with_frozen_heap_size)
    process.start()
    process.join(timeout=120)
    assert process.exitcode is not None and process.exitcode >= 100, (
        f"{process.exitcode} thousand frozen objects"
    )
