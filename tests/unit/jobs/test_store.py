"""The job store against real SQLite and PostgreSQL databases (the latter skipped, with the
reason, where no server runs; see tests/fixtures/postgres.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest

from service.errors import Conflict, JobNotFound, QueueFull
from service.jobs.model import Artifact, Job, JobError, JobStatus, Phase, PhaseTiming, Progress
from service.jobs.store import Admission, JobStore, utcnow
from tests.fixtures.postgres import fresh_database


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobStore]:
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / 'jobs.db'}"
        else:
            url = stack.enter_context(fresh_database())
        store = JobStore.from_url(url)
        stack.callback(store.dispose)
        store.create_schema()
        yield store


def new_job(offset_seconds: int = 0, tenant: str | None = None) -> Job:
    return Job(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        phase=Phase.QUEUED,
        spec={"source": "file:///x", "exports": [{"format": "safetensors"}]},
        created_at=utcnow() + timedelta(seconds=offset_seconds),
        tenant=tenant,
    )


def test_created_job_reads_back_identical(store: JobStore) -> None:
    job = store.create(new_job())
    assert store.get(job.id) == job


def test_unknown_job_is_not_found(store: JobStore) -> None:
    with pytest.raises(JobNotFound):
        store.get("0" * 32)


def test_other_tenants_job_is_not_found(store: JobStore) -> None:
    job = store.create(new_job(tenant="a"))
    assert store.get(job.id, tenant="a").id == job.id
    with pytest.raises(JobNotFound):
        store.get(job.id, tenant="b")


def test_queue_limit_refuses_beyond_max_queued(store: JobStore) -> None:
    store.create(new_job(), Admission(max_queued=2))
    store.create(new_job(), Admission(max_queued=2))
    with pytest.raises(QueueFull):
        store.create(new_job(), Admission(max_queued=2))


def test_a_job_is_claimed_once(store: JobStore) -> None:
    job = store.create(new_job())
    first = store.claim(job.id, "w1")
    assert first is not None and first.status is JobStatus.RUNNING and first.attempts == 1
    assert first.started_at is not None
    assert store.claim(job.id, "w2") is None


def test_a_claimed_job_is_never_running_in_phase_queued(store: JobStore) -> None:
    job = store.create(new_job())
    claimed = store.claim(job.id, "w1")
    assert claimed is not None
    assert (claimed.status, claimed.phase) == (JobStatus.RUNNING, Phase.DOWNLOAD)
    assert claimed.progress == Progress(0, None, "bytes")


def test_a_succeeded_job_keeps_its_final_progress(store: JobStore) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w")
    store.report(job.id, phase=Phase.FINALIZE, progress=Progress(0, 3, "files"))
    assert store.finish(job.id, JobStatus.SUCCEEDED, progress=Progress(3, 3, "files"))
    assert store.get(job.id).progress == Progress(3, 3, "files")


def test_queue_is_fifo(store: JobStore) -> None:
    later = store.create(new_job(offset_seconds=5))
    earlier = store.create(new_job(offset_seconds=0))
    assert store.next_queued(2) == [earlier.id, later.id]


def test_progress_and_finish_are_recorded(store: JobStore) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w")
    assert store.report(
        job.id, phase=Phase.EXPORT, progress=Progress(5, 10, "bytes"), metrics={"bytes_read": 5}
    )
    running = store.get(job.id)
    assert (running.phase, running.progress, running.metrics) == (
        Phase.EXPORT, Progress(5, 10, "bytes"), {"bytes_read": 5},
    )
    artifact = Artifact("manifest.json", 10, "ab" * 32)
    assert store.finish(job.id, JobStatus.SUCCEEDED, artifacts=[artifact])
    done = store.get(job.id)
    assert done.status is JobStatus.SUCCEEDED and done.phase is Phase.DONE
    assert done.artifacts == (artifact,) and done.finished_at is not None
    # a finished job takes no more progress and cannot finish twice
    assert not store.report(job.id, phase=Phase.EXPORT)
    assert not store.finish(job.id, JobStatus.FAILED, error=JobError("x", "y"))


def test_cancelling_a_queued_job_is_immediate(store: JobStore) -> None:
    job = store.create(new_job())
    cancelled = store.request_cancel(job.id)
    assert cancelled.status is JobStatus.CANCELLED
    with pytest.raises(Conflict):
        store.request_cancel(job.id)


def test_cancelling_a_running_job_flags_it(store: JobStore) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w")
    flagged = store.request_cancel(job.id)
    assert flagged.status is JobStatus.RUNNING and flagged.cancel_requested


def test_cancel_flags_of_several_jobs_are_read_at_once(store: JobStore) -> None:
    running = [store.create(new_job()) for _ in range(3)]
    for job in running:
        store.claim(job.id, "w")
    store.request_cancel(running[1].id)
    ids = [job.id for job in running] + ["0" * 32]
    assert store.cancel_requested(ids) == {running[1].id}
    assert store.cancel_requested([]) == set()


def test_changed_reports_only_jobs_whose_version_moved(store: JobStore) -> None:
    quiet, moving = store.create(new_job()), store.create(new_job())
    known = {quiet.id: quiet.version, moving.id: moving.version, "0" * 32: 0}
    store.claim(moving.id, "w")
    store.report(moving.id, phase=Phase.READ, progress=Progress(done=1, total=2, unit="tensors"))
    changed = store.changed(known)
    assert set(changed) == {moving.id, "0" * 32}
    assert changed["0" * 32] is None
    moved = changed[moving.id]
    assert moved is not None and moved == store.get(moving.id)
    assert moved.version == moving.version + 2 and moved.phase is Phase.READ
    assert store.changed({moving.id: moved.version}) == {}
    assert store.changed({}) == {}


def test_pages_walk_every_job_once_newest_first(store: JobStore) -> None:
    ids = [store.create(new_job(offset_seconds=i)).id for i in range(7)]
    seen: list[str] = []
    before = None
    while True:
        page = store.page(limit=3, before=before)
        seen += [j.id for j in page]
        if len(page) < 3:
            break
        before = (page[-1].created_at, page[-1].id)
    assert seen == list(reversed(ids))


def test_status_filter(store: JobStore) -> None:
    a = store.create(new_job())
    store.create(new_job())
    store.claim(a.id, "w")
    assert [j.id for j in store.page(status=JobStatus.RUNNING)] == [a.id]
    assert store.count(JobStatus.QUEUED) == 1


def test_requeue_resets_an_interrupted_job(store: JobStore) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w")
    store.report(job.id, phase=Phase.EXPORT, progress=Progress(3, 9))
    assert store.requeue(job.id)
    again = store.get(job.id)
    assert again.status is JobStatus.QUEUED and again.progress.done == 0
    assert again.attempts == 1


def test_worker_heartbeat_refreshes_only_its_own_running_jobs(store: JobStore) -> None:
    mine, theirs, queued = (store.create(new_job()) for _ in range(3))
    store.claim(mine.id, "w1")
    store.claim(theirs.id, "w2")
    version = store.get(mine.id).version
    assert store.heartbeat([mine.id, theirs.id, queued.id], "w1") == [mine.id]
    assert store.get(mine.id).version == version  # not a change watchers are told about


def test_a_running_job_without_heartbeat_is_stale_and_locked_once(store: JobStore) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w")
    assert store.stale_running(utcnow() - timedelta(seconds=60)) == []
    later = utcnow() + timedelta(seconds=1)
    assert store.stale_running(later) == [job.id]
    with store.transaction() as conn:
        locked = store.lock_stale(conn, job.id, later)
        assert locked is not None and locked.status is JobStatus.RUNNING
        assert store.requeue(job.id, conn=conn)
    with store.transaction() as conn:
        assert store.lock_stale(conn, job.id, later) is None
    assert store.get(job.id).status is JobStatus.QUEUED


def test_the_phase_timeline_and_the_removal_time_are_typed_fields_of_the_job(
    store: JobStore,
) -> None:
    job = store.create(new_job())
    store.claim(job.id, "w1")
    started = utcnow().replace(microsecond=0)
    running = [PhaseTiming(Phase.DOWNLOAD, started, 0.5, peak_rss_bytes=1 << 20),
               PhaseTiming(Phase.EXPORT, started + timedelta(seconds=1))]
    assert store.report(job.id, phase=Phase.EXPORT, phases=running, details={"model": {"a": 1}})
    assert store.get(job.id).phases == tuple(running)
    ended = [running[0], PhaseTiming(Phase.EXPORT, running[1].started_at, 2.0,
                                     peak_rss_bytes=2 << 20, cgroup_peak_bytes=3 << 20)]
    assert store.finish(job.id, JobStatus.SUCCEEDED, phases=ended)
    done = store.get(job.id)
    assert done.phases == tuple(ended) and done.details == {"model": {"a": 1}}
    assert done.deleted_at is None

    removed = store.mark_deleted(job.id, freed_bytes=10)
    assert removed is not None and removed.deleted_at is not None
    assert removed.deleted_at.tzinfo is not None and "deleted_at" not in removed.details
    again = store.mark_deleted(job.id, freed_bytes=10)  # already removed: the same tombstone
    assert again is not None and again.deleted_at == removed.deleted_at
