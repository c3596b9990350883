"""Removing a finished job's files (DELETE, retention) on a real SQLite store and real files."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from service.api.errors import http_status
from service.config import Settings
from service.errors import ArtifactGone, Conflict, InvalidRequest
from service.jobs.executors.local import LocalExecutor
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact, Job, JobStatus, Phase
from service.jobs.service import JobService
from service.jobs.store import JobStore, jobs_table, utcnow
from service.units import parse_duration


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    store = JobStore.from_url(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.create_schema()
    yield store
    store.dispose()


def service(store: JobStore, tmp_path: Path, **settings: object) -> JobService:
    config = Settings(data_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return JobService(settings=config, store=store, executor=LocalExecutor(config, store))


def finished_job(jobs: JobService, ended_ago: timedelta, status: JobStatus = JobStatus.SUCCEEDED,
                 size: int = 1000, tenant: str | None = None) -> str:
    """A finished job with ``size`` bytes of artifact and 10 bytes of work files on disk."""
    job_id = uuid.uuid4().hex
    layout = JobLayout.for_job(jobs.settings, job_id)
    layout.artifacts.mkdir(parents=True)
    (layout.artifacts / "model.safetensors").write_bytes(b"x" * size)
    layout.work.mkdir()
    (layout.work / "log.txt").write_bytes(b"y" * 10)
    now = utcnow()
    jobs.store.create(Job(
        id=job_id, status=JobStatus.RUNNING, phase=Phase.EXPORT, spec={}, tenant=tenant,
        created_at=now - ended_ago - timedelta(seconds=5)))
    jobs.store.finish(job_id, status, artifacts=[Artifact("model.safetensors", size, "0" * 64)])
    with jobs.store.transaction() as conn:  # backdate the end, as if it ended long ago
        conn.execute(jobs_table.update().where(jobs_table.c.id == job_id)
                     .values(finished_at=now - ended_ago))
    return job_id


def test_deleting_a_finished_job_removes_its_files_and_keeps_a_tombstone(
    store: JobStore, tmp_path: Path
) -> None:
    jobs = service(store, tmp_path, tenant_max_artifact_bytes=1500)
    job_id = finished_job(jobs, timedelta(0), tenant="a")
    assert jobs.artifact_bytes("a") == 1000

    job = jobs.delete(job_id, tenant="a")

    assert not (tmp_path / "jobs" / job_id).exists()
    assert job.status is JobStatus.SUCCEEDED and job.artifacts == ()
    assert job.deleted_at is not None and job.metrics["artifact_bytes_freed"] == 1010
    assert jobs.artifact_bytes("a") == 0  # the tenant's quota is free again
    with pytest.raises(ArtifactGone) as gone:
        jobs.artifact(job_id, "model.safetensors", tenant="a")
    assert http_status(gone.value) == 410
    again = jobs.delete(job_id, tenant="a")  # idempotent: same tombstone
    assert again.deleted_at == job.deleted_at
    assert again.metrics["artifact_bytes_freed"] == 1010


def test_a_running_job_is_not_a_deletion_candidate(store: JobStore, tmp_path: Path) -> None:
    jobs = service(store, tmp_path)
    job_id = uuid.uuid4().hex
    store.create(Job(id=job_id, status=JobStatus.RUNNING, phase=Phase.EXPORT, spec={},
                     created_at=utcnow()))
    with pytest.raises(Conflict):
        jobs.remove_files(job_id)


def test_retention_removes_only_jobs_finished_longer_ago_than_the_ttl(
    store: JobStore, tmp_path: Path
) -> None:
    jobs = service(store, tmp_path, artifact_ttl="30d")
    old = finished_job(jobs, timedelta(days=31))
    old_failed = finished_job(jobs, timedelta(days=40), status=JobStatus.FAILED)
    recent = finished_job(jobs, timedelta(days=29))

    assert sorted(jobs.expire_artifacts()) == sorted([old, old_failed])

    assert not (tmp_path / "jobs" / old).exists()
    assert not (tmp_path / "jobs" / old_failed).exists()
    assert (tmp_path / "jobs" / recent / "artifacts" / "model.safetensors").exists()
    assert store.get(old).metrics["artifact_bytes_freed"] == 1010
    assert jobs.expire_artifacts() == []  # tombstones are not found again


def test_without_a_ttl_nothing_expires(store: JobStore, tmp_path: Path) -> None:
    jobs = service(store, tmp_path)
    job_id = finished_job(jobs, timedelta(days=3650))
    assert jobs.expire_artifacts() == []
    assert (tmp_path / "jobs" / job_id / "artifacts").exists()


@pytest.mark.parametrize(("text", "seconds"), [
    ("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("45s", 45), ("2w", 14 * 86400),
    ("3600", 3600),
])
def test_durations_are_read_with_their_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30x", "-1d", "0", "d"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_duration(text)
