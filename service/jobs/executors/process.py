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
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from service.config import Settings
from service.errors import JobTimeout, MemoryBudgetExceeded, WorkerCrashed
from service.jobs.layout import JobLayout
from service.jobs.model import Job, JobError, JobStatus
from service.jobs.runner import run_job
from service.jobs.store import JobStore
from service.memory import JobCgroup, process_group_private_bytes

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


@dataclass
class MemoryGuard:
    """Holds one job's process group to its memory budget (``settings.job_memory``).

    With a memory cgroup of its own (:class:`JobCgroup`, made before the job starts, entered
    by the job first thing) the kernel enforces the budget inside that cgroup alone, and the
    guard sees the job stopped at its limit; without one, the guard sums the private bytes the
    kernel cannot drop (anonymous and dirty pages, not the clean pages of a mapped file) of the
    job's process group at each look. Either way the job is killed and failed
    ``memory_budget_exceeded`` before the container's OOM killer or its reclaim reaches the
    API, which lives outside every job's budget."""

    job_id: str
    settings: Settings
    cgroup: JobCgroup | None = None
    peak: int = 0
    """Largest charge seen (cgroup) or largest private anonymous and dirty bytes summed
    (accounting)."""

    @classmethod
    def for_job(cls, job_id: str, settings: Settings) -> MemoryGuard:
        """The guard of a job about to start; makes its cgroup when the service lives under a
        cgroup memory limit and may create cgroups (``MODELPREP_JOB_CGROUPS=auto``)."""
        guard = cls(job_id, settings)
        if settings.job_cgroups == "auto" and settings.memory_limit_source.startswith("cgroup"):
            assert settings.job_memory is not None
            try:
                guard.cgroup = JobCgroup.create(job_id, settings.job_memory)
            except OSError as exc:
                log.warning(
                    "no memory cgroup for the job (%s); accounting for its memory instead", exc,
                    extra={"job_id": job_id},
                )  # fmt: skip
        return guard

    def exceeded(self, process: BaseProcess) -> str | None:
        """Why the job is over its budget, or None."""
        budget = self.settings.job_memory or 0
        if self.cgroup is not None:
            self.peak = max(self.peak, self.cgroup.peak() or self.cgroup.usage())
            if not self.cgroup.out_of_memory():
                return None
            used = self.cgroup.peak() or self.cgroup.usage()
            how = f"its memory cgroup was full ({used / 2**30:.2f} GiB charged)"
        else:
            if process.pid is None:
                return None
            used = process_group_private_bytes(process.pid)
            self.peak = max(self.peak, used)
            if used <= budget:
                return None
            how = f"its processes held {used / 2**30:.2f} GiB"
        limit = self.settings.memory_budget
        return (
            f"the job needed more than its memory budget of {budget / 2**30:.2f} GiB "
            f"(MODELPREP_JOB_MEMORY: the {limit.limit / 2**30:.2f} GiB limit from "
            f"{limit.limit_source}, less {limit.api_share / 2**30:.2f} GiB for the API, over "
            f"{limit.workers} worker(s)): {how}; it was stopped before the service ran out"
        )

    def kill(self) -> None:
        """Kill whatever is left in the job's cgroup (a child that left its process group)."""
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> None:
        """Remove the job's cgroup once its processes are gone."""
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup.remove()


def stop_over_budget(
    store: JobStore, settings: Settings, job_id: str, process: BaseProcess, guard: MemoryGuard,
    message: str,
) -> None:
    """Kill a job over its memory budget, discard its files, fail it
    ``memory_budget_exceeded``."""
    kill_process_group(process)
    guard.kill()
    process.join(timeout=5)
    if store.finish(job_id, JobStatus.FAILED, error=JobError(MemoryBudgetExceeded.code, message)):
        JobLayout.for_job(settings, job_id).discard(keep_offload=settings.keep_failed_offload)
        log.warning(message, extra={"job_id": job_id})


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
    guard: MemoryGuard | None = None,
) -> None:
    """After the job process ended: if it left its job running, it crashed (signal, OOM kill),
    so the job fails with ``worker_crashed`` (``memory_budget_exceeded`` when its memory
    cgroup ran out) and its files are discarded.

    With ``worker``, only while the job is still that worker's: one presumed dead may find its
    job handed to another worker, whose attempt it must not touch."""
    process.join()
    job = store.get(job_id)
    if job.status is not JobStatus.RUNNING or (worker is not None and job.worker != worker):
        return
    JobLayout.for_job(settings, job_id).discard(keep_offload=settings.keep_failed_offload)
    over = guard.exceeded(process) if guard is not None and guard.cgroup is not None else None
    error = (
        JobError(MemoryBudgetExceeded.code, over)
        if over is not None
        else JobError(WorkerCrashed.code, describe_exit(process.exitcode))
    )
    store.finish(job_id, JobStatus.FAILED, error=error)
    log.warning(error.message, extra={"job_id": job_id})
