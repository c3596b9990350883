"""The embedded executor: a bounded pool of child processes fed from the job store.

A dispatcher thread in the service process claims queued jobs (FIFO) while fewer than
``settings.workers`` run, spawns one process per job (``spawn`` start method: no state
inherited from the server), and reaps them. A child that exits without writing a terminal
status crashed (signal, OOM kill); the dispatcher fails its job with ``worker_crashed``. A
cancelled job's whole process group is killed, then its files are removed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
from multiprocessing.process import BaseProcess

from service.config import Settings
from service.errors import WorkerCrashed
from service.jobs.layout import JobLayout
from service.jobs.model import Job, JobError, JobStatus
from service.jobs.runner import run_job
from service.jobs.store import JobStore

log = logging.getLogger(__name__)


def kill_process_group(process: BaseProcess) -> None:
    """SIGKILL the job process and everything it started (it leads its own group)."""
    pid = process.pid
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # not yet a group leader, or already gone: kill the process itself
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (possibly out of memory)" if exitcode == -signal.SIGKILL else ""
        return f"job process killed by {name}{hint}"
    return f"job process exited with code {exitcode} without reporting a result"


class LocalExecutor:
    def __init__(self, settings: Settings, store: JobStore, poll_seconds: float = 0.2) -> None:
        self.settings = settings
        self.store = store
        self.poll_seconds = poll_seconds
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self._mp = multiprocessing.get_context("spawn")
        self._running: dict[str, BaseProcess] = {}
        self._secrets: dict[str, dict[str, str]] = {}
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- Executor ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="modelprep-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            running = dict(self._running)
        for job_id, process in running.items():
            kill_process_group(process)
            process.join(timeout=10)
            # Interrupted by shutdown, not by the job: recovery re-queues it at next start.
            log.info("job interrupted by shutdown", extra={"job_id": job_id})

    def submit(self, job: Job, secrets: dict[str, str]) -> Job:
        with self._lock:
            if secrets:
                self._secrets[job.id] = secrets
        try:
            self.store.create(job, max_queued=self.settings.max_queued)
        except BaseException:
            with self._lock:
                self._secrets.pop(job.id, None)
            raise
        self._wake.set()
        return job

    def cancel(self, job_id: str, tenant: str | None = None) -> Job:
        job = self.store.request_cancel(job_id, tenant)
        if job.status is JobStatus.RUNNING:
            with self._lock:
                self._cancels.add(job_id)
            self._wake.set()
        else:
            with self._lock:
                self._secrets.pop(job_id, None)
        return job

    # --- dispatcher --------------------------------------------------------------------------

    @property
    def running_ids(self) -> list[str]:
        with self._lock:
            return list(self._running)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._tick()
            except Exception:  # a store hiccup must not end the pool; next tick retries
                log.exception("dispatcher tick failed")
            self._wake.wait(self.poll_seconds)
            self._wake.clear()

    def _tick(self) -> None:
        self._apply_cancels()
        self._reap()
        self._fill()

    def _apply_cancels(self) -> None:
        with self._lock:
            wanted = set(self._cancels)
            self._cancels.clear()
            running = dict(self._running)
        # Cancellation may also be requested through the store by another API process.
        for job_id in running:
            if job_id not in wanted and self.store.get(job_id).cancel_requested:
                wanted.add(job_id)
        for job_id in wanted:
            process = running.get(job_id)
            if process is None:
                continue
            kill_process_group(process)
            process.join(timeout=5)
            JobLayout.for_job(self.settings, job_id).remove()
            self.store.finish(
                job_id, JobStatus.CANCELLED, error=JobError("job_cancelled", "cancelled by request")
            )
            with self._lock:
                self._running.pop(job_id, None)
            log.info("cancelled", extra={"job_id": job_id})

    def _reap(self) -> None:
        with self._lock:
            running = dict(self._running)
        for job_id, process in running.items():
            if process.is_alive():
                continue
            process.join()
            if self.store.get(job_id).status is JobStatus.RUNNING:
                JobLayout.for_job(self.settings, job_id).discard(
                    keep_offload=self.settings.keep_failed_offload
                )
                self.store.finish(
                    job_id,
                    JobStatus.FAILED,
                    error=JobError(WorkerCrashed.code, describe_exit(process.exitcode)),
                )
                log.warning(describe_exit(process.exitcode), extra={"job_id": job_id})
            with self._lock:
                self._running.pop(job_id, None)

    def _fill(self) -> None:
        free = self.settings.workers - len(self.running_ids)
        if free <= 0:
            return
        for job_id in self.store.next_queued(free):
            if self.store.claim(job_id, self.worker_id) is None:
                continue
            with self._lock:
                secrets = self._secrets.pop(job_id, {})
            process = self._mp.Process(
                target=run_job,
                args=(job_id, self.settings, secrets, os.getpid()),
                name=f"modelprep-job-{job_id}",
            )
            process.start()
            with self._lock:
                self._running[job_id] = process
            log.info("started", extra={"job_id": job_id, "pid": process.pid})
