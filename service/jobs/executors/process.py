"""A job's child process as every executor runs it: a fresh process, leader of its own process
group, killed as a group, and settled by its parent when it ends without a result.

Job processes are forked by multiprocessing's *forkserver*: a clean process (started once,
single-threaded, never serving a request) that has already imported torch, transformers and the
pipeline, so a job starts in milliseconds instead of re-importing them for seconds. Nothing of
the service process is inherited. The forkserver exits when the service does, and every job
process dies with the forkserver (parent-death signal).

Shared by the local pool and the distributed worker so that a job behaves the same wherever it
runs: only the job id, the settings and per-job secrets cross into the child
(:func:`service.jobs.runner.run_job`), and the child dies with the process that spawned it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from multiprocessing.process import BaseProcess

from service.config import Settings
from service.errors import JobTimeout, WorkerCrashed
from service.jobs.layout import JobLayout
from service.jobs.model import Job, JobError, JobStatus
from service.jobs.runner import run_job
from service.jobs.store import JobStore

log = logging.getLogger(__name__)

PRELOAD = ["service.jobs.executors.freeze_preload"]
"""The forkserver imports this one module, which derives what jobs import and imports it
(:mod:`service.jobs.executors.preload`), then freezes the heap."""

_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(PRELOAD)


def _ready() -> None:
    """The no-op a warm-up process runs."""


def warm_up() -> None:
    """Start the forkserver and wait until it has imported ``PRELOAD`` (seconds), so that the
    first job does not pay for it while its executor is expected to answer heartbeats."""
    process = _FORKSERVER.Process(target=_ready, name="modelprep-warm-up")
    process.start()
    process.join()


def spawn_job_process(job_id: str, settings: Settings, secrets: dict[str, str]) -> BaseProcess:
    """Start the child that runs ``job_id``, forked from the preloaded forkserver."""
    process = _FORKSERVER.Process(
        target=run_job,
        args=(job_id, settings, secrets),
        name=f"modelprep-job-{job_id}",
    )
    process.start()
    return process


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


def stop_cancelled(store: JobStore, settings: Settings, job_id: str, process: BaseProcess) -> None:
    """Kill a cancelled job's processes, remove its files, record it cancelled."""
    kill_process_group(process)
    process.join(timeout=5)
    JobLayout.for_job(settings, job_id).remove()
    store.finish(
        job_id, JobStatus.CANCELLED, error=JobError("job_cancelled", "cancelled by request")
    )
    log.info("cancelled", extra={"job_id": job_id})


def time_limit(job: Job, settings: Settings) -> float | None:
    """Seconds ``job`` may run: the smaller of its own ``timeout`` and the service's."""
    own = job.spec.get("timeout")
    limits = [float(v) for v in (own, settings.job_timeout) if v is not None]
    return min(limits) if limits else None


def stop_timed_out(
    store: JobStore, settings: Settings, job_id: str, process: BaseProcess, limit: float
) -> None:
    """Kill a job that ran past its time limit, discard its files, fail it ``job_timeout``."""
    kill_process_group(process)
    process.join(timeout=5)
    message = f"job ran longer than its time limit of {limit:g} s and was killed"
    # Only a job still running is failed (and its files discarded): one that finished in the
    # last instant keeps its result.
    if store.finish(job_id, JobStatus.FAILED, error=JobError(JobTimeout.code, message)):
        JobLayout.for_job(settings, job_id).discard(keep_offload=settings.keep_failed_offload)
        log.warning(message, extra={"job_id": job_id})


def stop_interrupted(process: BaseProcess) -> None:
    """Kill a job's processes because its executor stops; the job is left for a retry."""
    kill_process_group(process)
    process.join(timeout=10)


def settle_exited(
    store: JobStore,
    settings: Settings,
    job_id: str,
    process: BaseProcess,
    worker: str | None = None,
) -> None:
    """After the job process ended: if it left its job running, it crashed (signal, OOM kill),
    so the job fails with ``worker_crashed`` and its files are discarded.

    With ``worker``, only while the job is still that worker's: one presumed dead may find its
    job handed to another worker, whose attempt it must not touch."""
    process.join()
    job = store.get(job_id)
    if job.status is not JobStatus.RUNNING or (worker is not None and job.worker != worker):
        return
    JobLayout.for_job(settings, job_id).discard(keep_offload=settings.keep_failed_offload)
    store.finish(
        job_id,
        JobStatus.FAILED,
        error=JobError(WorkerCrashed.code, describe_exit(process.exitcode)),
    )
    log.warning(describe_exit(process.exitcode), extra={"job_id": job_id})
