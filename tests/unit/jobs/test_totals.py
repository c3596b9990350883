"""The store's running totals (``job_totals``) and the /metrics collector built on them, on real
SQLite and PostgreSQL: what ended jobs add, exactly once, and what a scrape reads."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import MetaData, Table

from service.api.metrics import service_registry
from service.config import Settings
from service.jobs.model import Artifact, Job, JobError, JobStatus, Phase, PhaseTiming
from service.jobs.store import JobStore, job_totals, utcnow
from service.jobs.store.migrations import upgrade
from tests.fixtures.postgres import fresh_database


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'jobs.db'}"
    else:
        with fresh_database() as pg_url:
            yield pg_url


@pytest.fixture
def store(url: str) -> Iterator[JobStore]:
    store = JobStore.from_url(url)
    store.create_schema()
    yield store
    store.dispose()


def running(store: JobStore, tenant: str | None = "a", **metrics: object) -> str:
    now = utcnow()
    job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED, spec={},
              created_at=now - timedelta(seconds=3), tenant=tenant)
    store.create(job)
    assert store.claim(job.id, "w") is not None
    if metrics:
        store.report(job.id, metrics=dict(metrics))
    return job.id


def scrape(store: JobStore, tmp_path: Path) -> dict[str, float]:
    """Every sample of a real scrape, by name and labels (``name{k=v,...}``)."""
    text = generate_latest(service_registry(store, Settings(data_dir=tmp_path))).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_a_scrape_counts_ended_jobs_once_and_running_jobs_as_they_are(
    store: JobStore, tmp_path: Path
) -> None:
    done = running(store, bytes_read=100, bytes_written=40, cache_hit=False)
    store.finish(done, JobStatus.SUCCEEDED, artifacts=[Artifact("m.safetensors", 40, "0" * 64)],
                 metrics={"bytes_read": 100, "bytes_written": 40, "cache_hit": False},
                 phases=[PhaseTiming(Phase.DOWNLOAD, utcnow(), 0.3),
                         PhaseTiming(Phase.EXPORT, utcnow(), 7.0)])
    failed = running(store, bytes_read=5)
    store.finish(failed, JobStatus.FAILED, error=JobError("checkpoint_error", "bad"),
                 metrics={"bytes_read": 5})
    assert not store.finish(failed, JobStatus.FAILED)  # a second end adds nothing
    running(store, bytes_read=1000, cache_hit=True)  # still running: its report so far
    store.create(Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED,
                     spec={}, created_at=utcnow()))

    samples = scrape(store, tmp_path)
    assert samples["modelprep_job_bytes_read_total{}"] == 1105
    assert samples["modelprep_job_bytes_written_total{}"] == 40
    assert samples["modelprep_download_cache_hits_total{}"] == 1
    assert samples["modelprep_download_cache_misses_total{}"] == 1
    assert samples["modelprep_jobs{phase=done,status=succeeded}"] == 1
    assert samples["modelprep_jobs{phase=download,status=running}"] == 1
    assert samples["modelprep_queue_depth{}"] == 1 and samples["modelprep_jobs_running{}"] == 1
    export = "modelprep_job_phase_duration_seconds_bucket"
    assert samples[f"{export}{{le=5.0,phase=export}}"] == 0
    assert samples[f"{export}{{le=10.0,phase=export}}"] == 1
    assert samples["modelprep_job_phase_duration_seconds_sum{phase=export}"] == 7.0
    assert samples["modelprep_job_run_duration_seconds_count{status=failed}"] == 1
    assert samples["modelprep_job_queue_wait_seconds_count{}"] == 3  # the three that started
    assert samples["modelprep_artifact_bytes{}"] == 40
    again = scrape(store, tmp_path)  # a scrape changes nothing (but the disk's free space)
    free = "modelprep_data_dir_free_bytes{}"
    assert {k: v for k, v in again.items() if k != free} == {
        k: v for k, v in samples.items() if k != free}


def test_removing_files_moves_bytes_from_live_to_freed_once(store: JobStore) -> None:
    job_id = running(store, tenant="t")
    store.finish(job_id, JobStatus.SUCCEEDED, artifacts=[Artifact("a", 700, "0" * 64),
                                                         Artifact("b", 300, "0" * 64)])
    assert store.artifact_bytes("t") == 1000 and store.artifact_bytes("other") == 0
    store.mark_deleted(job_id, 1010)
    store.mark_deleted(job_id, 1010)  # removing twice frees once
    _, sums = store.statistics()
    assert store.artifact_bytes("t") == 0 and sums[("artifact_bytes_freed", "", "")] == 1010


def test_concurrent_ends_all_reach_the_totals(store: JobStore) -> None:
    """Twelve jobs finished at once from their own threads (and connections): every one is
    counted, none twice, with no deadlock between the upserts of the same rows."""
    ids = [running(store, tenant="t") for _ in range(12)]
    barrier = threading.Barrier(len(ids))

    def finish(job_id: str) -> None:
        barrier.wait()
        store.finish(job_id, JobStatus.SUCCEEDED, artifacts=[Artifact("m", 10, "0" * 64)],
                     metrics={"bytes_written": 10},
                     phases=[PhaseTiming(Phase.EXPORT, utcnow(), 1.0)])

    threads = [threading.Thread(target=finish, args=(i,)) for i in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    _, sums = store.statistics()
    assert store.artifact_bytes("t") == 120 and sums[("bytes_written", "", "")] == 120
    assert sums[("phase_seconds", "export", "1.0")] == 12


def test_the_migration_fills_the_totals_from_the_jobs_already_there(url: str) -> None:
    """A store at revision 0004 with ended jobs: upgrading adds up what they had done, the
    phase timeline read from ``details`` where jobs kept it then (revision 0008 moves it)."""
    with ExitStack() as stack:
        store = JobStore.from_url(url)
        stack.callback(store.dispose)
        upgrade(store.engine, "0004")
        with store.engine.begin() as conn:
            jobs = Table("jobs", MetaData(), autoload_with=conn)  # the 0004 shape
            now = utcnow()
            base = {"spec": {}, "updated_at": now, "progress_done": 0, "progress_unit": "bytes",
                    "attempts": 1, "cancel_requested": False, "version": 3, "details": {},
                    "created_at": now - timedelta(seconds=10),
                    "started_at": now - timedelta(seconds=8), "finished_at": now}
            conn.execute(jobs.insert(), [
                {**base, "id": "kept", "status": "succeeded", "phase": "done", "tenant": "a",
                 "artifacts": [{"path": "m", "size": 500, "sha256": "0" * 64}],
                 "metrics": {"bytes_read": 900},
                 "details": {"phases": [{"phase": "export", "started_at": now.isoformat(),
                                         "seconds": 0.7}]}},
                {**base, "id": "gone", "status": "succeeded", "phase": "done", "tenant": "a",
                 "artifacts": [], "details": {"deleted_at": now.isoformat()},
                 "metrics": {"bytes_read": 100, "artifact_bytes_freed": 450}},
                {**base, "id": "wait", "status": "queued", "phase": "queued", "tenant": "a",
                 "artifacts": [], "metrics": {}, "started_at": None, "finished_at": None},
            ])
        store.create_schema()
        _, sums = store.statistics()
        assert store.artifact_bytes("a") == 500
        assert sums[("bytes_read", "", "")] == 1000
        assert sums[("artifact_bytes_freed", "", "")] == 450
        assert sums[("run_seconds", "succeeded", "10.0")] == 2
        assert sums[("phase_seconds", "export", "1.0")] == 1
        with store.engine.connect() as conn:
            assert conn.execute(job_totals.select()).first() is not None
