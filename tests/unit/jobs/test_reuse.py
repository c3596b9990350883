"""Result reuse: the key, the store's settling under concurrency (real SQLite and PostgreSQL,
each settling job on its own connection), and sharing real files by hard links."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact, Job, JobStatus, Phase
from service.jobs.reuse import StoreReuse, reuse_key
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore, ReuseAction, utcnow
from service.sources import SourceIdentity, SourceRequest
from service.stage import InMemoryContext
from tests.fixtures.postgres import fresh_database


def spec(**fields: object) -> JobSpec:
    return JobSpec.model_validate(
        {"source": "file:///models/x", "exports": [{"format": "safetensors"}], **fields}
    )


def test_the_key_ignores_what_does_not_change_the_bytes() -> None:
    plain = reuse_key("files:abc", spec())
    assert reuse_key("files:abc", spec(exports=[{"format": "safetensors",
                                                 "max_shard_size": "5GB"}])) == plain
    assert reuse_key("files:abc", spec(max_memory="1GiB", timeout=60, reuse=False)) == plain
    assert reuse_key("files:abc", spec(source="file:///elsewhere")) == plain  # identity decides


def test_the_key_changes_with_the_source_the_exports_and_verification() -> None:
    plain = reuse_key("files:abc", spec())
    others = {
        reuse_key("files:abd", spec()),
        reuse_key("files:abc", spec(), tenant="acme"),
        reuse_key("files:abc", spec(verify=False)),
        reuse_key("files:abc", spec(exports=[{"format": "safetensors", "dtype": "float16"}])),
        reuse_key("files:abc", spec(exports=[{"format": "safetensors"},
                                             {"format": "safetensors", "dtype": "float16"}])),
        reuse_key("files:abc", spec(exports=[{"format": "safetensors", "dtype": "float16"},
                                             {"format": "safetensors"}])),
        reuse_key("files:abc", spec(verify_text="def f(x):\n    return x")),
    }
    assert plain not in others and len(others) == 7


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobStore]:
    with ExitStack() as stack:
        url = (f"sqlite:///{tmp_path / 'reuse.db'}" if request.param == "sqlite"
               else stack.enter_context(fresh_database()))
        store = JobStore.from_url(url)
        stack.callback(store.dispose)
        store.create_schema()
        yield store


def running_job(store: JobStore, tenant: str | None = None) -> str:
    job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED,
              spec={}, created_at=utcnow(), tenant=tenant)
    store.create(job)
    assert store.claim(job.id, "test:1") is not None
    return job.id


KEY = "ab" * 32
ARTIFACTS = [Artifact("safetensors/model.safetensors", 5, "0" * 64)]


def test_compute_then_wait_then_reuse_and_deleted_jobs_are_not_offered(store: JobStore) -> None:
    first, second, third = (running_job(store) for _ in range(3))
    assert store.settle_reuse(first, KEY).action is ReuseAction.COMPUTE
    waiting = store.settle_reuse(second, KEY)
    assert waiting.action is ReuseAction.WAIT and waiting.other is not None
    assert waiting.other.id == first
    assert store.settle_reuse(second, "cd" * 32).action is ReuseAction.COMPUTE  # other key
    store.finish(first, JobStatus.SUCCEEDED, artifacts=ARTIFACTS)
    reused = store.settle_reuse(third, KEY)
    assert reused.action is ReuseAction.REUSE and reused.other is not None
    assert reused.other.id == first and reused.other.artifacts == tuple(ARTIFACTS)
    assert store.get(third).reused_from == first
    assert store.settle_reuse(third, KEY, exclude={first}).action is ReuseAction.COMPUTE
    assert store.get(third).reused_from is None
    assert store.settle_reuse(running_job(store), KEY, reuse=False).action is ReuseAction.COMPUTE
    store.mark_deleted(first, 0)
    assert store.settle_reuse(running_job(store), KEY).action is not ReuseAction.REUSE


def test_a_requeued_identical_job_is_not_waited_for(store: JobStore) -> None:
    """A job back in the queue may wait for a worker slot the waiting job holds: waiting for
    it could deadlock a full pool, so the running job computes instead."""
    first, second = running_job(store), running_job(store)
    assert store.settle_reuse(first, KEY).action is ReuseAction.COMPUTE
    assert store.requeue(first)
    assert store.settle_reuse(second, KEY).action is ReuseAction.COMPUTE


def test_identical_jobs_settling_at_once_compute_once(store: JobStore) -> None:
    """Eight running jobs of one key settle at the same moment, each on its own connection:
    exactly one computes, the seven others wait for that one."""
    ids = [running_job(store) for _ in range(8)]
    barrier = threading.Barrier(len(ids))
    outcomes: dict[str, tuple[ReuseAction, str | None]] = {}

    def settle(job_id: str) -> None:
        barrier.wait()
        decision = store.settle_reuse(job_id, KEY)
        outcomes[job_id] = (decision.action, decision.other.id if decision.other else None)

    threads = [threading.Thread(target=settle, args=(job_id,)) for job_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    computing = [job_id for job_id, (action, _) in outcomes.items()
                 if action is ReuseAction.COMPUTE]
    assert len(outcomes) == 8 and len(computing) == 1, outcomes
    assert all(outcomes[job_id] == (ReuseAction.WAIT, computing[0])
               for job_id in ids if job_id != computing[0])


def published(settings: Settings, job_id: str, files: dict[str, bytes]) -> list[Artifact]:
    layout = JobLayout.for_job(settings, job_id)
    for rel, data in files.items():
        (layout.artifacts / rel).parent.mkdir(parents=True, exist_ok=True)
        (layout.artifacts / rel).write_bytes(data)
    return [Artifact(rel, len(data), "0" * 64) for rel, data in files.items()]


def test_shared_artifacts_are_hard_links_and_a_vanished_one_makes_the_job_compute(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    store = JobStore.from_url(settings.sqlalchemy_url)
    store.create_schema()
    try:
        source = SourceIdentity("files:" + "1" * 64, SourceRequest("file:///models/x"))
        files = {"safetensors/model.safetensors": b"weights", "manifest.json": b"{}"}
        original = running_job(store)
        store.finish(original, JobStatus.SUCCEEDED,
                     artifacts=published(settings, original, files))
        store.settle_reuse(original, reuse_key(source.key, spec()))

        def settle() -> tuple[str, list[Artifact] | None, InMemoryContext]:
            job_id = running_job(store)
            layout = JobLayout.for_job(settings, job_id)
            layout.prepare()
            ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
            return job_id, StoreReuse(store, layout, settings).settle(source, spec(), ctx), ctx

        reuser, shared, ctx = settle()
        assert shared is not None and [a.path for a in shared] == list(files)
        for rel in files:
            mine = JobLayout.for_job(settings, reuser).artifacts / rel
            assert os.path.samefile(mine, JobLayout.for_job(settings, original).artifacts / rel)
        assert ctx.details["reuse"]["reused_from"] == original
        assert ctx.metrics["reused_bytes"] == sum(len(d) for d in files.values())

        store.finish(reuser, JobStatus.SUCCEEDED, artifacts=shared)
        store.mark_deleted(reuser, 0)  # only the original is offered from here on
        (JobLayout.for_job(settings, original).artifacts / "manifest.json").unlink()
        late, none, ctx = settle()
        assert none is None and "reused_from" not in ctx.details["reuse"]
        layout = JobLayout.for_job(settings, late)
        assert list(layout.staging.iterdir()) == [] and not layout.artifacts.exists()
        assert store.get(late).reused_from is None
    finally:
        store.dispose()


def test_reuse_never_crosses_tenants(tmp_path: Path) -> None:
    """A tenant that only knows a file's sha256 must not get another tenant's artifacts."""
    settings = Settings(data_dir=tmp_path / "data")
    store = JobStore.from_url(settings.sqlalchemy_url)
    store.create_schema()
    try:
        source = SourceIdentity("sha256:" + "2" * 64, SourceRequest("https://example.org/m"))
        files = {"safetensors/model.safetensors": b"weights", "manifest.json": b"{}"}
        original = running_job(store, tenant="acme")
        store.finish(original, JobStatus.SUCCEEDED,
                     artifacts=published(settings, original, files))
        store.settle_reuse(original, reuse_key(source.key, spec(), "acme"))

        def settle(tenant: str) -> InMemoryContext:
            job_id = running_job(store, tenant=tenant)
            layout = JobLayout.for_job(settings, job_id)
            layout.prepare()
            ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
            StoreReuse(store, layout, settings).settle(source, spec(), ctx)
            return ctx

        assert "reused_from" not in settle("globex").details["reuse"]
        assert settle("acme").details["reuse"]["reused_from"] == original
    finally:
        store.dispose()
