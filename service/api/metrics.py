"""Prometheus metrics of the service, built in the API process at scrape time.

Job processes never keep registries of their own (they come and go, and a multi-process
registry would need shared files): they report to the job store, and
:class:`JobStoreCollector` turns the store into metrics when ``/metrics`` is scraped. HTTP
latency is an ordinary histogram of the API process (``service.api.telemetry``).

What is read per scrape: every job row, page by page (finished jobs never change, so their
contribution is computed once and cached by id), and the offload directories on disk
(``service.offload.usage``). That is a few milliseconds per thousand jobs.

Counters derived from jobs (bytes, cache hits) include running jobs' latest reports; a job
re-queued after a service restart starts its counters again, which Prometheus sees as a reset.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from service.config import Settings
from service.jobs.model import Job, JobStatus
from service.jobs.store import JobStore
from service.offload.usage import offload_usage

PHASE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                 3600.0, 7200.0, 21600.0, 86400.0)
BYTE_COUNTERS = {
    "bytes_read": "Bytes read from checkpoints by jobs.",
    "bytes_written": "Bytes written to artifacts by jobs.",
    "bytes_downloaded": "Bytes downloaded from sources by jobs (cache misses).",
    "artifact_bytes_freed": "Bytes of finished jobs' files removed (DELETE, retention).",
}


@dataclass(frozen=True)
class JobFigures:
    """What one job contributes to the metrics; computed once for a finished job."""

    phase_seconds: tuple[tuple[str, float], ...]
    run_seconds: float | None
    wait_seconds: float | None
    byte_counts: tuple[tuple[str, int], ...]
    cache_hit: bool | None

    @classmethod
    def of(cls, job: Job) -> JobFigures:
        phases = job.details.get("phases")
        timeline = [
            (str(p["phase"]), float(p["seconds"]))
            for p in (phases if isinstance(phases, list) else [])
            if isinstance(p, dict) and isinstance(p.get("seconds"), int | float)
        ]
        hit = job.metrics.get("cache_hit")
        return cls(
            phase_seconds=tuple(timeline),
            run_seconds=_seconds(job.started_at, job.finished_at),
            wait_seconds=_seconds(job.created_at, job.started_at),
            byte_counts=tuple(
                (key, int(job.metrics[key]))
                for key in BYTE_COUNTERS
                if isinstance(job.metrics.get(key), int | float)
            ),
            cache_hit=hit if isinstance(hit, bool) else None,
        )


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start and end else None


class _Histogram:
    """Cumulative bucket counts for a HistogramMetricFamily."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class JobStoreCollector(Collector):
    """Job, queue, byte and offload metrics read from the job store and the data directory."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self._finished: dict[str, tuple[int, JobFigures]] = {}
        self._lock = threading.Lock()  # two scrapes at once share the cache safely

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: registering must not query the store

    def _jobs(self) -> Iterator[Job]:
        before: tuple[datetime, str] | None = None
        while True:
            page = self.store.page(limit=500, before=before)
            yield from page
            if len(page) < 500:
                return
            before = (page[-1].created_at, page[-1].id)

    def collect(self) -> Iterable[Metric]:
        by_state: Counter[tuple[str, str]] = Counter()
        phases: dict[str, _Histogram] = {}
        runs: dict[str, _Histogram] = {}
        wait = _Histogram(PHASE_BUCKETS)
        byte_totals: Counter[str] = Counter()
        hits: Counter[bool] = Counter()
        with self._lock:
            for job in self._jobs():
                by_state[(job.status.value, job.phase.value)] += 1
                cached = self._finished.get(job.id)
                # A finished job changes once more when its files are removed.
                figures = cached[1] if cached and cached[0] == job.version else None
                if figures is None:
                    figures = JobFigures.of(job)
                    if job.status.terminal:
                        self._finished[job.id] = (job.version, figures)
                for key, value in figures.byte_counts:
                    byte_totals[key] += value
                if figures.cache_hit is not None:
                    hits[figures.cache_hit] += 1
                if figures.wait_seconds is not None:
                    wait.observe(figures.wait_seconds)
                if not job.status.terminal:
                    continue  # durations only of finished jobs: histograms never go back
                for phase, seconds in figures.phase_seconds:
                    phases.setdefault(phase, _Histogram(PHASE_BUCKETS)).observe(seconds)
                if figures.run_seconds is not None:
                    runs.setdefault(job.status.value, _Histogram(PHASE_BUCKETS)).observe(
                        figures.run_seconds
                    )

        jobs = GaugeMetricFamily(
            "modelprep_jobs", "Jobs in the store by status and phase.", labels=["status", "phase"]
        )
        for (status, phase), count in sorted(by_state.items()):
            jobs.add_metric([status, phase], count)
        yield jobs
        counts = Counter({s: 0 for s in JobStatus})
        for (status, _), count in by_state.items():
            counts[JobStatus(status)] += count
        yield GaugeMetricFamily(
            "modelprep_queue_depth", "Jobs waiting to run.", value=counts[JobStatus.QUEUED]
        )
        yield GaugeMetricFamily(
            "modelprep_jobs_running", "Jobs running now.", value=counts[JobStatus.RUNNING]
        )
        yield _histogram_family(
            "modelprep_job_phase_duration_seconds",
            "Time finished jobs spent in each pipeline phase.", "phase", phases,
        )
        yield _histogram_family(
            "modelprep_job_run_duration_seconds",
            "Time from start to end of finished jobs, by outcome.", "status", runs,
        )
        queue_wait = HistogramMetricFamily(
            "modelprep_job_queue_wait_seconds", "Time jobs waited in the queue before starting."
        )
        queue_wait.add_metric([], wait.buckets(), wait.total)
        yield queue_wait
        for key, help_text in BYTE_COUNTERS.items():
            yield CounterMetricFamily(f"modelprep_job_{key}", help_text, value=byte_totals[key])
        yield CounterMetricFamily(
            "modelprep_download_cache_hits", "Sources served from the download cache.",
            value=hits[True],
        )
        yield CounterMetricFamily(
            "modelprep_download_cache_misses", "Sources that had to be downloaded.",
            value=hits[False],
        )
        yield from self._offload()

    def _offload(self) -> Iterator[Metric]:
        usage: dict[str, Any] = offload_usage(self.settings)
        total = usage["total"]
        yield GaugeMetricFamily(
            "modelprep_offload_bytes", "Bytes on disk in jobs' offload directories.",
            value=total["bytes_on_disk"],
        )
        yield GaugeMetricFamily(
            "modelprep_offload_files", "Files in jobs' offload directories.", value=total["files"]
        )
        yield GaugeMetricFamily(
            "modelprep_data_dir_free_bytes", "Free disk space where jobs write.",
            value=usage["free_disk_bytes"],
        )


def _histogram_family(
    name: str, help_text: str, label: str, histograms: dict[str, _Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=[label])
    for value, histogram in sorted(histograms.items()):
        family.add_metric([value], histogram.buckets(), histogram.total)
    return family


def service_registry(store: JobStore, settings: Settings) -> CollectorRegistry:
    """The app's registry (not the process-global one: two apps in one process stay apart)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobStoreCollector(store, settings))
    return registry
