"""Per-tenant limits are enforced by JobService.submit (the domain), on a real SQLite store."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from service.api.errors import http_status
from service.config import Settings
from service.errors import QueueFull, TenantLimitExceeded
from service.jobs.executors.local import LocalExecutor
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact, Job, JobStatus, Phase
from service.jobs.runner import run_job
from service.jobs.service import JobService
from service.jobs.spec import JobSpec
from service.jobs.store import Admission, JobStore, utcnow
from tests.fixtures.postgres import fresh_database


def service_with(store: JobStore, base: Settings, **limits: object) -> JobService:
    """A JobService with a real executor that is not started: submit only queues."""
    settings = base.model_copy(update=limits)
    return JobService(settings=settings, store=store, executor=LocalExecutor(settings, store))


def spec(checkpoint: Path) -> JobSpec:
    return JobSpec.model_validate(
        {"source": f"file://{checkpoint}", "exports": [{"format": "safetensors"}]}
    )


def add_job(store: JobStore, tenant: str, status: JobStatus, size: int = 0) -> None:
    artifacts = (Artifact("model.safetensors", size, "0" * 64),) if size else ()
    store.create(Job(id=uuid.uuid4().hex, status=status, phase=Phase.QUEUED, spec={},
                     created_at=utcnow(), tenant=tenant, artifacts=artifacts))


def test_queued_limit_counts_only_the_tenants_waiting_jobs(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    jobs = service_with(store, base, tenant_max_queued=2)
    for _ in range(2):
        jobs.submit(spec(llama_safetensors_dir), tenant="a")
    with pytest.raises(TenantLimitExceeded, match="tenant a has 2 queued jobs") as err:
        jobs.submit(spec(llama_safetensors_dir), tenant="a")
    assert isinstance(err.value, QueueFull) and err.value.retry_after > 0
    assert http_status(err.value) == 429
    jobs.submit(spec(llama_safetensors_dir), tenant="b")  # another tenant is not affected
    jobs.submit(spec(llama_safetensors_dir), tenant=None)  # open mode has no tenant limits


def test_active_limit_counts_running_and_queued_jobs(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    jobs = service_with(store, base, tenant_max_active=2)
    add_job(store, "a", JobStatus.RUNNING)
    add_job(store, "a", JobStatus.SUCCEEDED)
    jobs.submit(spec(llama_safetensors_dir), tenant="a")
    with pytest.raises(TenantLimitExceeded, match="2 queued or running jobs"):
        jobs.submit(spec(llama_safetensors_dir), tenant="a")


def checkpoint_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.iterdir() if p.is_file())


def test_artifact_bytes_limit_counts_live_artifacts_and_queued_jobs_reservations(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    """A queued job of a local source reserves the source's size per export; the tenant's
    live artifacts and its reservations together must stay within the limit."""
    size = checkpoint_bytes(llama_safetensors_dir)
    jobs = service_with(store, base, tenant_max_artifact_bytes=600 + 2 * size)
    add_job(store, "a", JobStatus.SUCCEEDED, size=600)
    add_job(store, "b", JobStatus.SUCCEEDED, size=5000)
    first = jobs.submit(spec(llama_safetensors_dir), tenant="a")
    assert first.reserved_bytes == size and store.get(first.id).reserved_bytes == size
    jobs.submit(spec(llama_safetensors_dir), tenant="a")  # exactly at the limit
    assert jobs.artifact_bytes("a") == 600 and jobs.artifact_bytes() == 5600
    with pytest.raises(TenantLimitExceeded, match=f"holds {600 + 2 * size} artifact bytes"):
        jobs.submit(spec(llama_safetensors_dir), tenant="a")
    jobs.submit(spec(llama_safetensors_dir), tenant="b")  # another tenant is not affected
    store.finish(first.id, JobStatus.CANCELLED, from_statuses=(JobStatus.QUEUED,))
    jobs.submit(spec(llama_safetensors_dir), tenant="a")  # an ended job reserves nothing


def test_a_job_whose_artifacts_do_not_fit_fails_typed_and_keeps_no_files(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    """Reservations are estimates: what a job really wrote is checked when it ends. Here the
    tenant's room is taken by another job after this one was admitted; the job (a real job
    process) fails with tenant_limit_exceeded, its artifacts are removed, nothing is counted."""
    limit = checkpoint_bytes(llama_safetensors_dir) + 10
    jobs = service_with(store, base, tenant_max_artifact_bytes=limit)
    job = jobs.submit(spec(llama_safetensors_dir), tenant="a")
    add_job(store, "a", JobStatus.SUCCEEDED, size=limit - 5)
    assert store.claim(job.id, "test") is not None
    child = multiprocessing.get_context("spawn").Process(
        target=run_job, args=(job.id, jobs.settings, {})
    )
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0
    ended = store.get(job.id)
    assert ended.status is JobStatus.FAILED and ended.error is not None
    assert ended.error.type == "tenant_limit_exceeded" and "do not fit" in ended.error.message
    assert ended.artifacts == () and not JobLayout.for_job(jobs.settings, job.id).artifacts.exists()
    assert store.artifact_bytes("a") == limit - 5


def test_artifact_limit_accepts_human_sizes(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, tenant_max_artifact_bytes="2GiB")  # type: ignore[arg-type]
    assert settings.tenant_max_artifact_bytes == 2 * 1024**3


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobStore]:
    with ExitStack() as stack:
        url = (f"sqlite:///{tmp_path / 'race.db'}" if request.param == "sqlite"
               else stack.enter_context(fresh_database()))
        store = JobStore.from_url(url)
        stack.callback(store.dispose)
        store.create_schema()
        yield store


@pytest.mark.parametrize("limit", ["tenant_max_active", "tenant_max_queued", "max_queued",
                                   "tenant_max_artifact_bytes"])
def test_concurrent_submits_never_overshoot_a_limit(any_store: JobStore, limit: str) -> None:
    """Twelve submits released at once by a barrier, on their own connections: exactly the
    limit's worth get in, the rest are refused, and no error other than the limit's occurs.
    (Each job reserves 100 artifact bytes; the byte limit is 300 plus a 50-byte live one.)"""
    limits = Admission(**{limit: 350 if limit == "tenant_max_artifact_bytes" else 3})
    add_job(any_store, "a", JobStatus.SUCCEEDED, size=50)  # live bytes; counts for no job limit
    barrier = threading.Barrier(12)
    outcomes: list[str] = []

    def submit() -> None:
        job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED, spec={},
                  created_at=utcnow(), tenant="a", reserved_bytes=100)
        barrier.wait()
        try:
            any_store.create(job, limits)
            outcomes.append("admitted")
        except QueueFull:  # TenantLimitExceeded is one
            outcomes.append("refused")

    threads = [threading.Thread(target=submit) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["admitted"] * 3 + ["refused"] * 9
    assert any_store.count(JobStatus.QUEUED, "a") == 3


def test_concurrent_ends_never_overshoot_the_artifact_bytes_limit(any_store: JobStore) -> None:
    """Eight running jobs of one tenant end at once, each with 100 bytes of artifacts, under a
    limit of 350: exactly three succeed, the others are refused, and 300 bytes are live."""
    ids = []
    for _ in range(8):
        job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED, spec={},
                  created_at=utcnow(), tenant="a")
        any_store.create(job)
        assert any_store.claim(job.id, "w") is not None
        ids.append(job.id)
    barrier = threading.Barrier(len(ids))
    outcomes: list[str] = []

    def finish(job_id: str) -> None:
        barrier.wait()
        try:
            any_store.finish(job_id, JobStatus.SUCCEEDED, tenant_max_artifact_bytes=350,
                             artifacts=[Artifact("m.safetensors", 100, "0" * 64)])
            outcomes.append("succeeded")
        except TenantLimitExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=finish, args=(job_id,)) for job_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["refused"] * 5 + ["succeeded"] * 3
    assert any_store.artifact_bytes("a") == 300
    assert any_store.count(JobStatus.RUNNING, "a") == 5  # refused: still running, untouched
