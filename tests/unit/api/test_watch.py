"""JobWatch: the event streams of a process follow their jobs through one shared poll."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from service.api.watch import JobWatch
from service.jobs.model import Job, JobStatus, Phase, Progress
from service.jobs.store import JobStore, jobs_table, make_engine, utcnow


class CountingStore(JobStore):
    """A real SQLite store that counts the watcher's polls."""

    polls = 0

    def changed(self, known: Mapping[str, int]) -> dict[str, Job | None]:
        self.polls += 1
        return super().changed(known)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingStore]:
    store = CountingStore(make_engine(f"sqlite:///{tmp_path / 'jobs.db'}"))
    store.create_schema()
    yield store
    store.dispose()


def running_job(store: JobStore) -> Job:
    job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED,
              spec={"source": "file:///x"}, created_at=utcnow())
    store.create(job)
    claimed = store.claim(job.id, "w")
    assert claimed is not None
    return claimed


async def collect(watch: JobWatch, job: Job) -> list[Job]:
    return [state async for state in watch.follow(job)]


def test_streams_of_one_job_share_one_poll_and_get_every_state_to_the_end(
    store: CountingStore,
) -> None:
    job = running_job(store)
    watch = JobWatch(store, interval=0.01)

    async def scenario() -> tuple[list[Job], list[Job]]:
        streams = [asyncio.create_task(collect(watch, job)) for _ in range(2)]
        await asyncio.sleep(0.05)
        store.report(job.id, phase=Phase.READ, progress=Progress(1, 2, "tensors"))
        await asyncio.sleep(0.05)
        store.finish(job.id, JobStatus.SUCCEEDED)
        first, second = await asyncio.wait_for(asyncio.gather(*streams), timeout=5)
        return first, second

    started = time.monotonic()
    first, second = asyncio.run(scenario())
    elapsed = time.monotonic() - started
    assert [s.status for s in first] == [JobStatus.RUNNING, JobStatus.RUNNING, JobStatus.SUCCEEDED]
    assert [s.phase for s in first][:2] == [Phase.DOWNLOAD, Phase.READ]
    assert [s.version for s in first] == [s.version for s in second]
    assert 0 < store.polls <= elapsed / watch.interval + 1, "one poll per tick, not per stream"
    assert not watch._followed


def test_a_newer_state_brought_by_a_new_stream_reaches_the_waiting_ones(
    store: CountingStore,
) -> None:
    """A stream starts from its own read of the job, which may be newer than the watch's; the
    streams already waiting must get it then, not from a poll that sees no change any more."""
    job = running_job(store)
    watch = JobWatch(store, interval=3600)  # no poll during the test

    async def scenario() -> list[Job]:
        waiting = asyncio.create_task(collect(watch, job))
        await asyncio.sleep(0.05)
        store.finish(job.id, JobStatus.SUCCEEDED)
        assert [s.status for s in await collect(watch, store.get(job.id))] == [
            JobStatus.SUCCEEDED
        ]
        return await asyncio.wait_for(waiting, timeout=5)

    assert [s.status for s in asyncio.run(scenario())] == [JobStatus.RUNNING, JobStatus.SUCCEEDED]


def test_a_finished_job_is_followed_to_its_state_only(store: CountingStore) -> None:
    job = running_job(store)
    store.finish(job.id, JobStatus.FAILED)
    finished = store.get(job.id)
    states = asyncio.run(collect(JobWatch(store, interval=0.01), finished))
    assert states == [finished]
    assert store.polls == 0


def test_a_job_removed_from_the_store_ends_its_stream(store: CountingStore) -> None:
    job = running_job(store)
    watch = JobWatch(store, interval=0.01)

    async def scenario() -> list[Job]:
        stream = asyncio.create_task(collect(watch, job))
        await asyncio.sleep(0.05)
        with store.transaction() as conn:
            conn.execute(jobs_table.delete().where(jobs_table.c.id == job.id))
        return await asyncio.wait_for(stream, timeout=5)

    assert asyncio.run(scenario()) == [job]


def test_a_failing_poll_is_retried_instead_of_ending_the_streams(
    store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = running_job(store)
    watch = JobWatch(store, interval=0.01)
    real_changed = store.changed
    failures = iter([True, True])

    def flaky(known: Mapping[str, int]) -> dict[str, Job | None]:
        if next(failures, False):
            raise OSError("database is locked")
        return real_changed(known)

    monkeypatch.setattr(store, "changed", flaky)

    async def scenario() -> list[Job]:
        stream = asyncio.create_task(collect(watch, job))
        await asyncio.sleep(0.05)
        store.finish(job.id, JobStatus.SUCCEEDED)
        return await asyncio.wait_for(stream, timeout=5)

    assert [s.status for s in asyncio.run(scenario())] == [JobStatus.RUNNING, JobStatus.SUCCEEDED]
