"""Per-tenant limits are enforced by JobService.submit (the domain), on a real SQLite store."""

from __future__ import annotations

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
from service.jobs.model import Artifact, Job, JobStatus, Phase
from service.jobs.service import JobService
from service.jobs.spec import JobSpec
from service.jobs.store import Admission, JobStore, utcnow
from tests.fixtures.postgres import fresh_database


@pytest.fixture
def base(tmp_path: Path, llama_safetensors_dir: Path) -> Settings:
    return Settings(data_dir=tmp_path, local_roots=[llama_safetensors_dir.parent])


@pytest.fixture
def store(base: Settings) -> Iterator[JobStore]:
    store = JobStore.from_url(base.sqlalchemy_url)
    store.create_schema()
    yield store
    store.dispose()


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


def test_artifact_bytes_limit_counts_succeeded_jobs_artifacts(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    jobs = service_with(store, base, tenant_max_artifact_bytes=1000)
    add_job(store, "a", JobStatus.SUCCEEDED, size=600)
    add_job(store, "b", JobStatus.SUCCEEDED, size=5000)
    jobs.submit(spec(llama_safetensors_dir), tenant="a")  # 600 < 1000
    add_job(store, "a", JobStatus.SUCCEEDED, size=400)
    assert jobs.artifact_bytes("a") == 1000 and jobs.artifact_bytes() == 6000
    with pytest.raises(TenantLimitExceeded, match="1000 artifact bytes"):
        jobs.submit(spec(llama_safetensors_dir), tenant="a")


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


@pytest.mark.parametrize("limit", ["tenant_max_active", "tenant_max_queued", "max_queued"])
def test_concurrent_submits_never_overshoot_a_limit(any_store: JobStore, limit: str) -> None:
    """Twelve submits released at once by a barrier, on their own connections: exactly the
    limit's worth get in, the rest are refused, and no error other than the limit's occurs."""
    limits = Admission(**{limit: 3})
    add_job(any_store, "a", JobStatus.SUCCEEDED)  # finished jobs count for no limit
    barrier = threading.Barrier(12)
    outcomes: list[str] = []

    def submit() -> None:
        job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED, spec={},
                  created_at=utcnow(), tenant="a")
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
