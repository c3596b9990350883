"""``modelprep worker``: runs jobs queued in PostgreSQL, each in a child process of its own.

A worker is a procrastinate worker running at most ``settings.workers`` jobs at once. Its one
task claims the job row and spawns the same child process as the local pool
(:mod:`service.jobs.executors.process`), then waits for it on the event loop:

- ``DELETE`` on the API aborts the procrastinate job (NOTIFY, with polling as a fallback) and
  flags the row; either way the worker kills the job's process group, removes its files and
  records it cancelled, within a second or so.
- SIGTERM kills running jobs and re-queues them (``WorkerStopped`` makes procrastinate retry
  its job), after ``worker_shutdown_grace_seconds``.
- A child that exits without a result crashed: the job fails with ``worker_crashed``.

Liveness has two heartbeats. procrastinate's own (``procrastinate_workers``) says a worker
lives; the job row's ``heartbeat_at`` says its job does. The job process writes the latter on
every progress report, and the worker's timer every ``heartbeat_interval_seconds``, so that a
quiet phase is not taken for death. Every worker also reaps, on the same timer:

- a running job whose row heartbeat is older than ``heartbeat_timeout_seconds`` lost its worker
  (kill -9, container gone; its job process died with it through the parent-death signal). In
  one transaction the row is re-queued (the :mod:`service.jobs.recovery` policy: cancelled if
  asked, failed after ``MAX_ATTEMPTS``) and its procrastinate job delivered again; another
  worker then runs it from scratch. Stages are idempotent, so there is one set of artifacts.
- procrastinate's ``get_stalled_jobs`` (jobs of workers whose heartbeat stopped) whose row is no
  longer running are delivered again, so none stays ``doing`` forever; that run finds the row
  not queued and ends at once.

Heartbeats are guarded by the worker's name: a worker that was presumed dead and finds its job
handed to another kills its own attempt without touching the row.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import procrastinate
from procrastinate.exceptions import ConnectorException
from procrastinate.job_context import AbortReason, JobContext
from procrastinate.manager import JobManager

from service.config import Settings, outbound_line
from service.errors import JobNotFound, WorkerStopped
from service.fsutil import ensure_writable_dir
from service.jobs.callbacks import CallbackDeliverer, RenderJob
from service.jobs.executors.distributed import TASK_NAME, JobQueue, libpq_url
from service.jobs.executors.process import (
    MemoryGuard,
    settle_exited,
    spawn_job_process,
    stop_cancelled,
    stop_interrupted,
    stop_over_budget,
    stop_timed_out,
    time_limit,
    warm_up,
)
from service.jobs.layout import JobLayout
from service.jobs.model import JobStatus
from service.jobs.recovery import release_interrupted
from service.jobs.store import JobStore, utcnow
from service.objectstore import outbound_report

log = logging.getLogger(__name__)

PROCESS_POLL_SECONDS = 0.2
"""How often a job's task looks whether its process ended."""
CANCEL_POLL_SECONDS = 1.0
"""How often it reads the row's cancel flag (procrastinate's abort usually comes first)."""


async def _off_loop(fn: Callable[..., Any], *args: Any) -> None:
    """Run blocking clean-up in a thread and see it through even if this task is cancelled
    again meanwhile (a second abort must not leave a job half cleaned)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


@dataclass
class WorkerRuntime:
    """This worker's state, shared by its job tasks, its heartbeat timer and its reaper."""

    settings: Settings
    store: JobStore
    name: str
    health_file: Path | None = None
    queue: JobQueue = field(default_factory=JobQueue)
    running: dict[str, BaseProcess] = field(default_factory=dict)

    # --- one job -----------------------------------------------------------------------------

    async def run(self, job_id: str, context: JobContext) -> str:
        """Run ``job_id`` in a child process to its end; returns how it went, for the logs."""
        job = await asyncio.to_thread(self.store.claim, job_id, self.name)
        if job is None:  # cancelled before it started, or delivered again after it ended
            log.info("job is not queued; nothing to run", extra={"job_id": job_id})
            return "not queued"
        # Off the loop: a fork from the forkserver must not delay heartbeats.
        guard = await asyncio.to_thread(MemoryGuard.for_job, job_id, self.settings)
        process = await asyncio.to_thread(spawn_job_process, job_id, self.settings, {})
        self.running[job_id] = process
        log.info(
            "started",
            extra={"job_id": job_id, "pid": process.pid, "attempt": job.attempts},
        )
        try:
            return await self._watch(job_id, process, time_limit(job, self.settings), guard)
        except asyncio.CancelledError:
            if context.abort_reason() is AbortReason.SHUTDOWN:
                await _off_loop(self._release_on_shutdown, job_id, process)
                raise WorkerStopped(f"worker {self.name} stopped under job {job_id}") from None
            await _off_loop(stop_cancelled, self.store, self.settings, job_id, process)
            raise
        finally:
            self.running.pop(job_id, None)
            await asyncio.to_thread(guard.close)

    async def _watch(
        self, job_id: str, process: BaseProcess, limit: float | None, guard: MemoryGuard
    ) -> str:
        next_cancel_check = time.monotonic() + CANCEL_POLL_SECONDS
        deadline = None if limit is None else time.monotonic() + limit
        while process.is_alive():
            await asyncio.sleep(PROCESS_POLL_SECONDS)
            if deadline is not None and limit is not None and time.monotonic() >= deadline:
                await _off_loop(stop_timed_out, self.store, self.settings, job_id, process, limit)
                return "timed out"
            over = await asyncio.to_thread(guard.exceeded, process)
            if over is not None:
                await _off_loop(
                    stop_over_budget, self.store, self.settings, job_id, process, guard, over
                )
                return "over its memory budget"
            if time.monotonic() < next_cancel_check:
                continue
            next_cancel_check = time.monotonic() + CANCEL_POLL_SECONDS
            job = await asyncio.to_thread(self.store.get, job_id)
            if job.cancel_requested and job.status is JobStatus.RUNNING:
                await _off_loop(stop_cancelled, self.store, self.settings, job_id, process)
                return "cancelled"
        await asyncio.to_thread(
            settle_exited, self.store, self.settings, job_id, process, self.name, guard
        )
        return "ended"

    def _release_on_shutdown(self, job_id: str, process: BaseProcess) -> None:
        stop_interrupted(process)
        with self.store.transaction() as conn:
            job = self.store.get(job_id, conn=conn)
            if job.status is not JobStatus.RUNNING or job.worker != self.name:
                return
            outcome = release_interrupted(self.store, job, conn, why="worker shutdowns")
        JobLayout.for_job(self.settings, job_id).discard()
        log.info("released at shutdown", extra={"job_id": job_id, "outcome": outcome.value})

    # --- heartbeats --------------------------------------------------------------------------

    async def keep_alive(self) -> None:
        """Every heartbeat interval: mark this worker's jobs alive; stop attempts it lost."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_seconds)
            try:
                await self.beat()
            except Exception:  # a database hiccup must not end the worker; next beat retries
                log.exception("heartbeat failed")

    async def beat(self) -> None:
        if self.health_file is not None:
            self.health_file.touch()
        ids = list(self.running)
        if not ids:
            return
        alive = set(await asyncio.to_thread(self.store.heartbeat, ids, self.name))
        for job_id in ids:
            process = self.running.get(job_id)
            if job_id in alive or process is None:
                continue
            job = await asyncio.to_thread(self.store.get, job_id)
            if job.status is JobStatus.RUNNING and job.worker != self.name:
                log.warning(
                    "job was handed to another worker; stopping this attempt",
                    extra={"job_id": job_id, "worker": job.worker},
                )
                await asyncio.to_thread(stop_interrupted, process)

    # --- reaping -----------------------------------------------------------------------------

    async def reap_forever(self, manager: JobManager) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_seconds)
            try:
                await self.reap(manager)
            except Exception:  # as above: the next round retries
                log.exception("reaping stalled jobs failed")

    async def reap(self, manager: JobManager) -> int:
        """Release jobs whose worker stopped heartbeating; returns how many."""
        timeout = self.settings.heartbeat_timeout_seconds
        cutoff = utcnow() - timedelta(seconds=timeout)
        released = 0
        for job_id in await asyncio.to_thread(self.store.stale_running, cutoff):
            if job_id not in self.running and await asyncio.to_thread(
                self._release_stale, job_id, cutoff
            ):
                released += 1
        stalled = await manager.get_stalled_jobs(
            task_name=TASK_NAME, seconds_since_heartbeat=timeout
        )
        for entry in stalled:
            job_id = str(entry.task_kwargs.get("job_id", ""))
            if entry.id is not None and job_id not in self.running:
                await asyncio.to_thread(self._redeliver_stalled, entry.id, job_id)
        return released

    def _release_stale(self, job_id: str, cutoff: Any) -> bool:
        with self.store.transaction() as conn:
            job = self.store.lock_stale(conn, job_id, cutoff)
            if job is None:  # another worker got there first, or the job came back to life
                return False
            outcome = release_interrupted(self.store, job, conn, why="lost workers")
            if outcome is JobStatus.QUEUED:
                self.queue.redeliver(conn, job_id)
            else:
                for entry in self.queue.entries(conn, job_id):
                    if entry["status"] == procrastinate.jobs.Status.DOING.value:
                        self.queue.retry(conn, entry["id"])
        layout = JobLayout.for_job(self.settings, job_id)
        if outcome is JobStatus.CANCELLED:
            layout.remove()
        else:
            layout.discard()
        log.warning(
            "job's worker stopped heartbeating",
            extra={"job_id": job_id, "lost_worker": job.worker, "outcome": outcome.value},
        )
        return True

    def _redeliver_stalled(self, queue_job_id: int, job_id: str) -> None:
        try:
            with self.store.transaction() as conn:
                try:
                    job = self.store.get(job_id, conn=conn)
                except JobNotFound:
                    job = None
                if job is not None and job.status is JobStatus.RUNNING:
                    return  # its own heartbeat decides, in _release_stale
                self.queue.retry(conn, queue_job_id)
        except ConnectorException as exc:  # another worker redelivered it a moment ago
            log.info("stalled queue job already moved: %s", exc, extra={"job_id": job_id})
            return
        log.info("redelivered a stalled queue job", extra={"job_id": job_id})


async def run_queued_job(context: JobContext, job_id: str) -> str:
    """The procrastinate task of every modelprep job (see the module docstring)."""
    runtime = context.additional_context["runtime"]
    assert isinstance(runtime, WorkerRuntime)
    return await runtime.run(job_id, context)


def worker_app(settings: Settings) -> procrastinate.App:
    """procrastinate's app for a worker: an async pool on the job store's database, the task."""
    connector = procrastinate.PsycopgConnector(
        conninfo=libpq_url(settings.sqlalchemy_url), min_size=1, max_size=4
    )
    app = procrastinate.App(connector=connector)
    app.task(
        name=TASK_NAME,
        pass_context=True,
        # Only a worker's own shutdown puts the queue job back; a job's failures are recorded
        # on its row and never retried by the queue.
        retry=procrastinate.RetryStrategy(retry_exceptions={WorkerStopped}),
    )(run_queued_job)
    return app


async def serve(
    settings: Settings, health_file: Path | None = None, render: RenderJob | None = None
) -> None:
    """Run one worker until SIGTERM/SIGINT; with ``render`` (the API's job JSON), it also
    delivers completion callbacks, on a thread of its own (never in a job slot)."""
    ensure_writable_dir(settings.data_dir, "MODELPREP_DATA_DIR")
    ensure_writable_dir(settings.jobs_dir, "MODELPREP_DATA_DIR")
    outbound = outbound_report(settings)
    log.info("outbound connections: %s", outbound_line(outbound), extra={"outbound": outbound})
    store = JobStore.from_url(settings.sqlalchemy_url)
    await asyncio.to_thread(store.create_schema)
    runtime = WorkerRuntime(
        settings=settings,
        store=store,
        name=f"{socket.gethostname()}:{os.getpid()}",
        health_file=health_file,
    )
    await asyncio.to_thread(warm_up)  # before taking jobs: their heartbeats must not wait
    deliverer = CallbackDeliverer(settings, store, render) if render is not None else None
    if deliverer is not None:
        deliverer.start()
    app = worker_app(settings)
    async with app.open_async():
        side_tasks = [
            asyncio.create_task(runtime.keep_alive(), name="modelprep-heartbeat"),
            asyncio.create_task(runtime.reap_forever(app.job_manager), name="modelprep-reaper"),
        ]
        log.info(
            "worker ready", extra={"worker": runtime.name, "concurrency": settings.workers}
        )
        if health_file is not None:
            health_file.touch()
        try:
            await app.run_worker_async(
                name=runtime.name,
                concurrency=settings.workers,
                additional_context={"runtime": runtime},
                fetch_job_polling_interval=settings.worker_poll_seconds,
                abort_job_polling_interval=CANCEL_POLL_SECONDS,
                update_heartbeat_interval=settings.heartbeat_interval_seconds,
                stalled_worker_timeout=settings.heartbeat_timeout_seconds,
                shutdown_graceful_timeout=settings.worker_shutdown_grace_seconds,
                delete_jobs="successful",  # the job row is the record; the queue stays small
            )
        finally:
            for task in side_tasks:
                task.cancel()
            await asyncio.gather(*side_tasks, return_exceptions=True)
            if deliverer is not None:
                await asyncio.to_thread(deliverer.stop)
            await asyncio.to_thread(store.dispose)
            log.info("worker stopped", extra={"worker": runtime.name})


def run_worker(
    settings: Settings, health_file: Path | None = None, render: RenderJob | None = None
) -> None:
    """Blocking entry point of ``modelprep worker``."""
    asyncio.run(serve(settings, health_file, render))
