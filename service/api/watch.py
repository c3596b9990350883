"""One poll of the store for every job that the event streams of this API process follow.

A ``GET /v1/jobs/{id}/events`` stream wants each new state of its job. Rather than each stream
reading its job every ``POLL_SECONDS`` (a query and a thread hop per stream per tick), a
:class:`JobWatch` asks the store once per tick which of the followed jobs changed
(:meth:`JobStore.changed`: their versions in one query, rows only for those that moved) and
wakes the streams of those jobs. The poll runs while at least one stream follows a job.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from service.jobs.model import Job
from service.jobs.store import JobStore

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
"""How often the store is asked for changes of the followed jobs."""


@dataclass(eq=False)
class _Followed:
    job: Job
    """The newest state seen."""
    followers: int = 0
    gone: bool = False
    """The job no longer exists."""
    moved: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (then replaced by a fresh event) whenever ``job`` or ``gone`` changes."""

    def wake(self) -> None:
        self.moved.set()
        self.moved = asyncio.Event()


class JobWatch:
    """The followed jobs of one API process and the poll that refreshes them."""

    def __init__(self, store: JobStore, interval: float = POLL_SECONDS) -> None:
        self.store = store
        self.interval = interval
        self._followed: dict[str, _Followed] = {}
        self._poller: asyncio.Task[None] | None = None

    async def follow(self, job: Job) -> AsyncGenerator[Job, None]:
        """``job``, then each newer state of it, until a terminal one (or the job is gone)."""
        entry = self._followed.get(job.id)
        if entry is None:
            entry = self._followed[job.id] = _Followed(job)
        elif job.version > entry.job.version:
            # This stream read the job after the last poll: the streams waiting on the entry
            # get the newer state now (the next poll would see no change any more).
            entry.job = job
            entry.wake()
        entry.followers += 1
        self._ensure_polling()
        try:
            current = entry.job
            yield current
            while not current.status.terminal and not entry.gone:
                if entry.job.version > current.version:
                    current = entry.job
                    yield current
                else:
                    await entry.moved.wait()
        finally:
            entry.followers -= 1
            if entry.followers == 0 and self._followed.get(job.id) is entry:
                del self._followed[job.id]

    def _ensure_polling(self) -> None:
        loop = asyncio.get_running_loop()
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            # A fresh context: the poll serves every stream, not the request that started it.
            self._poller = loop.create_task(
                self._poll(), name="modelprep-job-watch", context=contextvars.Context()
            )

    async def _poll(self) -> None:
        while self._followed:
            await asyncio.sleep(self.interval)
            known = {job_id: entry.job.version for job_id, entry in self._followed.items()}
            try:
                # Off the event loop whatever the store: one read for every followed job
                # may be large, and it is one thread hop per tick however many streams.
                changed = await run_in_threadpool(self.store.changed, known)
            except Exception:  # a store hiccup must not leave the streams waiting forever
                log.exception("polling the followed jobs failed; next tick retries")
                continue
            for job_id, job in changed.items():
                entry = self._followed.get(job_id)
                if entry is None:
                    continue
                if job is None:
                    entry.gone = True
                elif job.version > entry.job.version:
                    entry.job = job
                else:
                    continue
                entry.wake()
