"""What a pipeline stage sees of its job: phases, progress, metrics, details, cancellation.

A leaf module: the stage packages (sources, checkpoint, offload, exporters, verification) depend on
it and never on :mod:`service.jobs`, which orchestrates them (the dependency rule in
ARCHITECTURE.md, enforced by tests/unit/test_architecture.py). Stages never touch the job store
or HTTP; the job runner supplies a context backed by the store, benchmarks and tests an
:class:`InMemoryContext`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from service.config import Settings
from service.errors import JobCancelled

log = logging.getLogger(__name__)


class Phase(StrEnum):
    """Pipeline phases in the order they run; a job skips those it does not need."""

    QUEUED = "queued"
    DOWNLOAD = "download"
    READ = "read"
    BUILD = "build"
    OFFLOAD = "offload"
    EXPORT = "export"
    VERIFY = "verify"
    FINALIZE = "finalize"
    DONE = "done"


@dataclass(frozen=True)
class PhaseTiming:
    """One entry of a job's phase timeline (``/metrics`` turns it into per-phase histograms)."""

    phase: Phase
    started_at: datetime
    seconds: float | None = None
    """How long the phase took; None while it runs."""
    peak_rss_bytes: int | None = None
    """The job process's peak resident bytes during the phase, where measured."""
    cgroup_peak_bytes: int | None = None
    """The job cgroup's peak charge during the phase, where the job has a cgroup."""

    def peaks(self) -> dict[str, int]:
        """The memory peaks measured, by name (none while the phase runs)."""
        found = {"peak_rss_bytes": self.peak_rss_bytes, "cgroup_peak_bytes": self.cgroup_peak_bytes}
        return {name: value for name, value in found.items() if value is not None}

    def to_json(self) -> dict[str, Any]:
        """The entry as the job JSON shows it (and the store keeps it)."""
        return {"phase": self.phase.value, "started_at": self.started_at.isoformat(),
                "seconds": self.seconds, **self.peaks()}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> PhaseTiming:
        seconds = entry.get("seconds")
        return cls(
            phase=Phase(entry["phase"]),
            started_at=datetime.fromisoformat(entry["started_at"]),
            seconds=None if seconds is None else float(seconds),
            peak_rss_bytes=entry.get("peak_rss_bytes"),
            cgroup_peak_bytes=entry.get("cgroup_peak_bytes"),
        )


class JobContext(Protocol):
    job_id: str
    settings: Settings
    work_dir: Path
    """Scratch space of this job; removed when the job ends whatever the outcome."""
    details: dict[str, Any]
    """Sections published so far with :meth:`set_detail` (read-only for stages)."""
    phases: list[PhaseTiming]
    """The phase timeline so far (read-only for stages)."""

    def set_phase(self, phase: Phase, total: int | None = None, unit: str = "bytes") -> None: ...

    def advance(self, n: int) -> None:
        """Add ``n`` units of progress in the current phase."""
        ...

    def check_abort(self) -> None:
        """Raise :class:`JobCancelled` if the job was cancelled; call between units of work."""
        ...

    def add_metric(self, key: str, value: float) -> None:
        """Accumulate a numeric metric (bytes_read, bytes_written, ...)."""
        ...

    def set_metric(self, key: str, value: Any) -> None: ...

    def set_detail(self, section: str, value: Any) -> None:
        """Publish a section of the job JSON (``model``, ``source``, ``verify``, ...)."""
        ...


@dataclass
class InMemoryContext:
    """A complete context that keeps everything in memory (benchmarks, tests, offline runs);
    the runner's store-backed context extends it by persisting every change (:meth:`_changed`).
    """

    settings: Settings
    work_dir: Path
    job_id: str = "local"
    phase: Phase = Phase.QUEUED
    done: int = 0
    total: int | None = None
    unit: str = "bytes"
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    phases: list[PhaseTiming] = field(default_factory=list)
    """The timeline: every phase entered, in order."""
    cancel_event: threading.Event = field(default_factory=threading.Event)
    _phase_started: float = 0.0

    def set_phase(self, phase: Phase, total: int | None = None, unit: str = "bytes") -> None:
        """Enter ``phase`` with a new progress count. Entering the phase the job is already in
        (the pipeline enters download, then the source's fetcher does, once it knows a total)
        restarts its count without starting another entry of the timeline."""
        if self.phases and self.phases[-1].phase is phase:
            self.total, self.unit, self.done = total, unit, 0
            self._changed(force=True)
            return
        self.close_phase()
        self._phase_started = time.monotonic()
        self.phases.append(PhaseTiming(phase, datetime.now(UTC)))
        self.phase, self.total, self.unit, self.done = phase, total, unit, 0
        log.info("phase %s", phase.value, extra={"job_id": self.job_id, "phase": phase.value})
        self._changed(force=True)

    def close_phase(self) -> None:
        """Record how long the current phase took (its ``seconds`` in the timeline)."""
        if self.phases and self.phases[-1].seconds is None:
            seconds = round(time.monotonic() - self._phase_started, 3)
            self.phases[-1] = dataclasses.replace(self.phases[-1], seconds=seconds)

    @property
    def phases_seen(self) -> list[Phase]:
        """The phases entered, in order."""
        return [entry.phase for entry in self.phases]

    def advance(self, n: int) -> None:
        self.done += n
        self._changed()

    def check_abort(self) -> None:
        self._changed()
        if self.cancel_event.is_set():
            raise JobCancelled(f"job {self.job_id} was cancelled")

    def add_metric(self, key: str, value: float) -> None:
        self.metrics[key] = self.metrics.get(key, 0) + value

    def set_metric(self, key: str, value: Any) -> None:
        self.metrics[key] = value

    def set_detail(self, section: str, value: Any) -> None:
        self.details[section] = value
        self._changed(force=True)

    def _changed(self, force: bool = False) -> None:
        """Called after every change of progress or details; nothing to persist here."""


class SideContext:
    """A job's context for a stage's side work (a verification's own dispatch, fetching a second
    source such as an imatrix): cancellation is the job's, while phase, progress and details stay
    private so they never overwrite the figures that describe the job's main work. Metrics go
    to the job under ``metric_prefix`` (``None`` drops them)."""

    def __init__(self, ctx: JobContext, work_dir: Path, metric_prefix: str | None = None) -> None:
        self._ctx = ctx
        self._prefix = metric_prefix
        self.job_id = ctx.job_id
        self.settings = ctx.settings
        self.work_dir = work_dir
        self.details: dict[str, Any] = {}
        self.phases: list[PhaseTiming] = []

    def set_phase(self, phase: Phase, total: int | None = None, unit: str = "bytes") -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def check_abort(self) -> None:
        self._ctx.check_abort()

    def add_metric(self, key: str, value: float) -> None:
        if self._prefix is not None:
            self._ctx.add_metric(f"{self._prefix}{key}", value)

    def set_metric(self, key: str, value: Any) -> None:
        if self._prefix is not None:
            self._ctx.set_metric(f"{self._prefix}{key}", value)

    def set_detail(self, section: str, value: Any) -> None:
        self.details[section] = value
