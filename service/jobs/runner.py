"""One job, one child process: the entry point an executor spawns, and its store-backed context.

The child owns its job from start to terminal status: it opens its own database engine, runs the
pipeline and writes the outcome. If it dies without writing one (signal, OOM kill), the executor
that spawned it marks the job failed. Only the job id, the settings and per-job secrets cross
the process boundary; no torch object ever does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass

from service.config import Settings
from service.errors import JobCancelled, MemoryBudgetExceeded, ServiceError
from service.jobs.layout import JobLayout
from service.jobs.model import JobError, JobStatus, Progress
from service.jobs.store import JobStore
from service.memory import JobCgroup, peak_rss, reset_peak_rss
from service.memory.heap import pin_mmap_threshold
from service.memory.libc import set_parent_death_signal
from service.offload.paths import job_store_dir
from service.offload.usage import store_usage
from service.shims.multiprocessing import release_forkserver
from service.stage import InMemoryContext

log = logging.getLogger(__name__)


def peak_rss_bytes(earlier: int = 0) -> int:
    """Peak resident set of this process and of the children it waited for; ``earlier``: the
    peak before this process's count was last reset (phases reset it)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own * 1024, children * 1024, earlier)


def _enter_job_cgroup(job_id: str) -> JobCgroup | None:
    """Move this process into the memory cgroup the executor made for the job, before it
    allocates anything: every byte of the job and of what it starts is charged there."""
    cgroup = JobCgroup.existing(job_id)
    if cgroup is None:
        return None
    try:
        cgroup.enter()
    except OSError as exc:
        log.warning("could not enter the job's memory cgroup %s: %s", cgroup.path, exc)
        return None
    return cgroup


def memory_details(settings: Settings, cgroup: JobCgroup | None) -> dict[str, object]:
    """The job's ``memory`` section: the limit, the job's budget and how it is held."""
    budget = settings.memory_budget
    return {
        "limit_bytes": budget.limit,
        "limit_source": budget.limit_source,
        "job_budget_bytes": budget.job,
        "confinement": f"cgroup{cgroup.version}" if cgroup is not None else "accounting",
    }


OFFLOAD_REPORT_SECONDS = 5.0
"""How often a job walks its offload store to report its figures (a walk per progress write
would cost more than the write)."""


@dataclass(kw_only=True)
class StoreContext(InMemoryContext):
    """A :class:`JobContext` that reports to the job store, throttled so that byte-level
    progress costs a database write at most every ``settings.progress_interval_seconds``;
    a cancellation seen in the store makes the next ``check_abort`` raise."""

    store: JobStore
    cgroup: JobCgroup | None = None
    """The job's own memory cgroup, when the executor made one (else it accounts for the
    job's process group itself)."""
    _last_flush: float = 0.0
    _earlier_peak: int = 0
    """This process's peak RSS before the last per-phase reset."""
    _last_offload_report: float = 0.0

    def _report_offload(self) -> None:
        """The job's offload-store figures in ``details["offload_usage"]``: the API reads them
        from the database for ``/v1/offload`` when the store is on a worker's own disk."""
        root = job_store_dir(self.settings.jobs_dir, self.job_id)
        if root.is_dir():
            self.details["offload_usage"] = {**store_usage(root), "host": socket.gethostname()}

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self._earlier_peak)

    def close_phase(self) -> None:
        """Also record the phase's peaks: this process's resident bytes (reset per phase) and
        the job cgroup's charge (its children and the page cache it filled included)."""
        if self.phases and self.phases[-1].seconds is None:
            peak = peak_rss()
            if peak is not None:
                self._earlier_peak = max(self._earlier_peak, peak)
            cgroup_peak = None
            if self.cgroup is not None:
                cgroup_peak = self.cgroup.peak()
                self.cgroup.reset_peak()
            self.phases[-1] = dataclasses.replace(
                self.phases[-1], peak_rss_bytes=peak, cgroup_peak_bytes=cgroup_peak
            )
            reset_peak_rss()
        super().close_phase()

    def _changed(self, force: bool = False) -> None:
        self.flush(force)

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < self.settings.progress_interval_seconds:
            return
        self._last_flush = now
        self.metrics["peak_rss_bytes"] = self.peak_rss_bytes()
        if force or now - self._last_offload_report >= OFFLOAD_REPORT_SECONDS:
            self._last_offload_report = now
            self._report_offload()
        still_running = self.store.report(
            self.job_id,
            phase=self.phase,
            progress=Progress(self.done, self.total, self.unit),
            metrics=self.metrics,
            details=self.details,
            phases=self.phases,
        )
        if not still_running or self.store.get(self.job_id).cancel_requested:
            self.cancel_event.set()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the forkserver, which lives exactly
    as long as the service) dies, so no orphan job keeps writing into a directory that recovery
    will hand to the next attempt."""
    release_forkserver()
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)  # without prctl (not Linux) the executor's checks do
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def run_job(job_id: str, settings: Settings, secrets: dict[str, str]) -> None:
    """Child-process entry point: run job ``job_id`` to a terminal status."""
    os.setsid()  # own process group: the executor kills the job and all it started at once
    cgroup = _enter_job_cgroup(job_id)
    # Below the API's priority: a job saturating the CPUs must not make status polls and
    # event streams wait (bench/api_latency.py). Inherited by whatever the job starts.
    os.nice(settings.job_nice)
    _die_with_parent()
    pin_mmap_threshold()  # activations mapped apart, not left in the heap (service.memory.heap)
    from service.logs import configure_logging

    configure_logging(settings, job_id=job_id)
    store = JobStore.from_url(settings.sqlalchemy_url)
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    # Libraries that call tempfile.mkdtemp (torch-to-nnef) then leave nothing outside the job.
    os.environ["TMPDIR"] = str(layout.tmp)
    tempfile.tempdir = str(layout.tmp)
    ctx = StoreContext(
        job_id=job_id, settings=settings, work_dir=layout.work, store=store, cgroup=cgroup
    )
    ctx.details["memory"] = memory_details(settings, cgroup)
    reset_peak_rss()
    started = time.monotonic()
    failed = True
    try:
        job = store.get(job_id)
        from service.jobs.pipeline import run_pipeline
        from service.jobs.spec import JobSpec

        spec = JobSpec.model_validate({**job.spec, **secrets})
        from service.jobs.reuse import StoreReuse

        artifacts = run_pipeline(
            spec, ctx, layout, StoreReuse(store, layout, settings), tenant=job.tenant
        )
        ctx.metrics["wall_seconds"] = round(time.monotonic() - started, 3)
        ctx.metrics["peak_rss_bytes"] = ctx.peak_rss_bytes()
        ctx.close_phase()
        # Scratch space goes before the job is seen succeeded, so no one who sees it so finds
        # its work files still there.
        layout.clean()
        store.finish(
            job_id,
            JobStatus.SUCCEEDED,
            artifacts=artifacts,
            metrics=ctx.metrics,
            details=ctx.details,
            phases=ctx.phases,
            progress=Progress(ctx.done, ctx.total, ctx.unit),
            tenant_max_artifact_bytes=settings.tenant_max_artifact_bytes,
        )
        failed = False
        log.info("succeeded", extra={"job_id": job_id})
    except JobCancelled as exc:
        _finish_failed(store, ctx, JobStatus.CANCELLED, exc, started)
    except ServiceError as exc:
        if cgroup is not None and cgroup.out_of_memory():
            # A child (tract, onnxruntime, llama.cpp) the kernel stopped at the job's limit.
            exc = MemoryBudgetExceeded(
                f"the job's processes needed more than its memory budget of "
                f"{cgroup.limit / 2**30:.2f} GiB (MODELPREP_JOB_MEMORY): {exc.message}"
            )
        log.warning("failed: %s: %s", exc.code, exc.message, extra={"job_id": job_id})
        _finish_failed(store, ctx, JobStatus.FAILED, exc, started)
    except MemoryError as exc:
        _finish_failed(store, ctx, JobStatus.FAILED, exc, started, code="out_of_memory")
    except Exception as exc:  # noqa: BLE001 - the job fails with the cause; the service never does
        log.error("internal error\n%s", traceback.format_exc(), extra={"job_id": job_id})
        _finish_failed(store, ctx, JobStatus.FAILED, exc, started, code="internal_error")
    finally:
        if failed:
            layout.discard(keep_offload=settings.keep_failed_offload)
        store.dispose()


def _finish_failed(
    store: JobStore,
    ctx: StoreContext,
    status: JobStatus,
    exc: BaseException,
    started: float,
    code: str | None = None,
) -> None:
    if isinstance(exc, ServiceError):
        error = JobError(code or exc.code, exc.message)
    else:
        error = JobError(code or "internal_error", f"{type(exc).__name__}: {exc}")
    ctx.metrics["wall_seconds"] = round(time.monotonic() - started, 3)
    ctx.metrics["peak_rss_bytes"] = ctx.peak_rss_bytes()
    ctx.close_phase()
    store.finish(
        ctx.job_id,
        status,
        error=error,
        metrics=ctx.metrics,
        details=ctx.details,
        phases=ctx.phases,
    )
