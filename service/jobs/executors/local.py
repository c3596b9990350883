"""The embedded executor: a bounded pool of child processes fed from the job store.

A dispatcher thread in the service process claims queued jobs (FIFO) while fewer than
``settings.workers`` run, starts one process per job (forked by the preloaded forkserver: no
state inherited from the server), and reaps them. A child that exits without writing a terminal
status crashed (signal, OOM kill); the dispatcher fails its job with ``worker_crashed``. A
cancelled job's whole process group is killed, then its files are removed. The child
process handling is shared with distributed workers (``executors/process.py``).

The dispatcher sleeps until something happens: a submit or a cancel of this process (a wake-up
pipe), a job process ending (its sentinel), or, every ``poll_seconds``, a look at what only the
store knows (a cancel flagged by another API process, a job queued by one). It shares the GIL
with the API's event loop, so it does not wake up for nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from service.config import Settings
from service.jobs.executors.base import admission
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
from service.jobs.model import Job, JobStatus
from service.jobs.recovery import recover_interrupted
from service.jobs.store import JobStore

log = logging.getLogger(__name__)


class LocalExecutor:
    def __init__(self, settings: Settings, store: JobStore, poll_seconds: float = 1.0) -> None:
        self.settings = settings
        self.store = store
        self.poll_seconds = poll_seconds
        """Longest sleep of the dispatcher: how late it sees what only the store tells."""
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self._running: dict[str, BaseProcess] = {}
        self._secrets: dict[str, dict[str, str]] = {}
        self._cancels: set[str] = set()
        self._deadlines: dict[str, tuple[float, float]] = {}
        self._guards: dict[str, MemoryGuard] = {}
        """job id -> what holds the job to its memory budget (looked at every tick)."""
        """job id -> (monotonic deadline, time limit in seconds), for jobs with a limit."""
        self._lock = threading.Lock()
        self._wake_pipe: tuple[int, int] | None = None
        """(read, write) ends of the pipe that wakes the dispatcher; open while it runs."""
        self._stopping = threading.Event()
        self._warm = threading.Event()
        """Set once the forkserver has imported what jobs need (``warm_up``)."""
        self._thread: threading.Thread | None = None

    # --- Executor ----------------------------------------------------------------------------

    def start(self) -> None:
        """Re-queue jobs a previous run of this pool left running, then start dispatching."""
        recover_interrupted(self.store, self.settings)
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        self._wake_pipe = (read_end, write_end)
        self._thread = threading.Thread(target=self._loop, name="modelprep-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
        if self._thread is not None and self._warm.is_set():
            # Still warming up, the (daemon) thread has run nothing: a stop need not wait
            # the seconds the forkserver takes to import torch.
            self._thread.join(timeout=30)
        with self._lock:
            running = dict(self._running)
        for job_id, process in running.items():
            stop_interrupted(process)
            self._forget(job_id)
            # Interrupted by shutdown, not by the job: recovery re-queues it at next start.
            log.info("job interrupted by shutdown", extra={"job_id": job_id})
        if self._thread is None or not self._thread.is_alive():
            with self._lock:  # so that no _wake() writes to a closed (or reused) descriptor
                for fd in self._wake_pipe or ():
                    os.close(fd)
                self._wake_pipe = None

    def submit(self, job: Job, secrets: dict[str, str]) -> Job:
        with self._lock:
            if secrets:
                self._secrets[job.id] = secrets
        try:
            self.store.create(job, admission(self.settings))
        except BaseException:
            with self._lock:
                self._secrets.pop(job.id, None)
            raise
        self._wake()
        return job

    def cancel(self, job_id: str, tenant: str | None = None) -> Job:
        job = self.store.request_cancel(job_id, tenant)
        if job.status is JobStatus.RUNNING:
            with self._lock:
                self._cancels.add(job_id)
            self._wake()
        else:
            with self._lock:
                self._secrets.pop(job_id, None)
        return job

    # --- dispatcher --------------------------------------------------------------------------

    @property
    def running_ids(self) -> list[str]:
        with self._lock:
            return list(self._running)

    def _wake(self) -> None:
        """Make the dispatcher tick now (from any thread; never blocks)."""
        with self._lock:
            if self._wake_pipe is None:
                return  # not dispatching: the first tick after start() sees everything
            try:
                os.write(self._wake_pipe[1], b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def _loop(self) -> None:
        warm_up()
        self._warm.set()
        while not self._stopping.is_set():
            try:
                self._tick()
            except Exception:  # a store hiccup must not end the pool; next tick retries
                log.exception("dispatcher tick failed")
                self._stopping.wait(self.poll_seconds)  # not a sentinel wait: one may be ready
                continue
            self._sleep()

    def _sleep(self) -> None:
        """Until a wake-up, a job process ends, or ``poll_seconds`` pass."""
        assert self._wake_pipe is not None
        read_end = self._wake_pipe[0]
        with self._lock:
            sentinels = [process.sentinel for process in self._running.values()]
            deadlines = [deadline for deadline, _ in self._deadlines.values()]
        timeout = self.poll_seconds
        if deadlines:
            timeout = max(0.0, min(timeout, min(deadlines) - time.monotonic()))
        if read_end in wait([read_end, *sentinels], timeout=timeout):
            try:
                while os.read(read_end, 4096):
                    pass
            except BlockingIOError:
                pass  # drained

    def _tick(self) -> None:
        self._apply_cancels()
        self._apply_timeouts()
        self._apply_memory_budgets()
        self._reap()
        self._fill()

    def _forget(self, job_id: str) -> None:
        """Drop an ended job's bookkeeping and its memory cgroup."""
        with self._lock:
            self._running.pop(job_id, None)
            self._deadlines.pop(job_id, None)
            guard = self._guards.pop(job_id, None)
        if guard is not None:
            guard.close()

    def _apply_memory_budgets(self) -> None:
        with self._lock:
            running = dict(self._running)
            guards = dict(self._guards)
        for job_id, process in running.items():
            guard = guards.get(job_id)
            over = guard.exceeded(process) if guard is not None else None
            if guard is None or over is None:
                continue
            stop_over_budget(self.store, self.settings, job_id, process, guard, over)
            self._forget(job_id)

    def _apply_timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = {job_id: limit for job_id, (deadline, limit) in self._deadlines.items()
                   if deadline <= now and job_id in self._running}
            running = dict(self._running)
        for job_id, limit in due.items():
            stop_timed_out(self.store, self.settings, job_id, running[job_id], limit)
            self._forget(job_id)

    def _apply_cancels(self) -> None:
        with self._lock:
            wanted = set(self._cancels)
            self._cancels.clear()
            running = dict(self._running)
        # Cancellation may also be requested through the store by another API process.
        wanted |= self.store.cancel_requested(list(running))
        for job_id in wanted:
            process = running.get(job_id)
            if process is None:
                continue
            stop_cancelled(self.store, self.settings, job_id, process)
            self._forget(job_id)

    def _reap(self) -> None:
        with self._lock:
            running = dict(self._running)
        for job_id, process in running.items():
            if process.is_alive():
                continue
            with self._lock:
                guard = self._guards.get(job_id)
            settle_exited(self.store, self.settings, job_id, process, guard=guard)
            self._forget(job_id)

    def _fill(self) -> None:
        free = self.settings.workers - len(self.running_ids)
        if free <= 0:
            return
        for job_id in self.store.next_queued(free):
            job = self.store.claim(job_id, self.worker_id)
            if job is None:
                continue
            with self._lock:
                secrets = self._secrets.pop(job_id, {})
            limit = time_limit(job, self.settings)
            guard = MemoryGuard.for_job(job_id, self.settings)
            process = spawn_job_process(job_id, self.settings, secrets)
            with self._lock:
                self._running[job_id] = process
                self._guards[job_id] = guard
                if limit is not None:
                    self._deadlines[job_id] = (time.monotonic() + limit, limit)
            log.info("started", extra={"job_id": job_id, "pid": process.pid})
