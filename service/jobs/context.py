"""The narrow interface a pipeline stage sees of its job: progress, metrics, cancellation.

Stages never touch the job store or HTTP; the runner supplies a context backed by the store,
benchmarks and tests an :class:`InMemoryContext`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from service.config import Settings
from service.errors import JobCancelled
from service.jobs.model import Phase


class JobContext(Protocol):
    job_id: str
    settings: Settings
    work_dir: Path
    """Scratch space of this job; removed when the job ends whatever the outcome."""
    details: dict[str, Any]
    """Sections published so far with :meth:`set_detail` (read-only for stages)."""

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
    """A complete context that keeps everything in memory (benchmarks, tests, offline runs)."""

    settings: Settings
    work_dir: Path
    job_id: str = "local"
    phase: Phase = Phase.QUEUED
    done: int = 0
    total: int | None = None
    unit: str = "bytes"
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    phases_seen: list[Phase] = field(default_factory=list)
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def set_phase(self, phase: Phase, total: int | None = None, unit: str = "bytes") -> None:
        self.phase, self.total, self.unit, self.done = phase, total, unit, 0
        self.phases_seen.append(phase)

    def advance(self, n: int) -> None:
        self.done += n

    def check_abort(self) -> None:
        if self.cancel_event.is_set():
            raise JobCancelled(f"job {self.job_id} was cancelled")

    def add_metric(self, key: str, value: float) -> None:
        self.metrics[key] = self.metrics.get(key, 0) + value

    def set_metric(self, key: str, value: Any) -> None:
        self.metrics[key] = value

    def set_detail(self, section: str, value: Any) -> None:
        self.details[section] = value
