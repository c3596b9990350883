"""Prometheus metrics of the service, built in the API process at scrape time.

Job processes never keep registries of their own (they come and go, and a multi-process
registry would need shared files): they report to the job store, and
:class:`JobStoreCollector` turns the store into metrics when ``/metrics`` is scraped. HTTP
latency is an ordinary histogram of the API process (``service.api.telemetry``).

What is read per scrape, in one snapshot: jobs counted by status and phase (a GROUP BY), the
totals that ended jobs added up to (``job_totals``, see :mod:`service.jobs.totals`: a few
hundred rows) and the rows of running jobs; then the offload directories on disk
(``service.offload.usage``). Nothing is kept between scrapes, so neither the scrape's time
nor the API's memory grows with the number of jobs in the store (bench/metrics_scale.py).

Counters derived from jobs (bytes, cache hits) include running jobs' latest reports; a job
re-queued after a service restart starts its counters again, which Prometheus sees as a reset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
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
from service.jobs import totals
from service.jobs.model import CallbackState, JobStatus
from service.jobs.store import JobStore, utcnow
from service.jobs.totals import BYTE_COUNTERS, TotalKey
from service.offload.usage import offload_usage


class JobStoreCollector(Collector):
    """Job, queue, byte and offload metrics read from the job store and the data directory."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: registering must not query the store

    def collect(self) -> Iterable[Metric]:
        by_state, sums = self.store.statistics()
        jobs = GaugeMetricFamily(
            "modelprep_jobs", "Jobs in the store by status and phase.", labels=["status", "phase"]
        )
        for (status, phase), count in sorted(by_state.items()):
            jobs.add_metric([status, phase], count)
        yield jobs
        counts = Counter({s.value: 0 for s in JobStatus})
        for (status, _), count in by_state.items():
            counts[status] += count
        yield GaugeMetricFamily(
            "modelprep_queue_depth", "Jobs waiting to run.", value=counts[JobStatus.QUEUED.value]
        )
        yield GaugeMetricFamily(
            "modelprep_jobs_running", "Jobs running now.", value=counts[JobStatus.RUNNING.value]
        )
        yield _histogram_family(
            "modelprep_job_phase_duration_seconds",
            "Time finished jobs spent in each pipeline phase.", "phase", sums, "phase_seconds",
        )
        yield _histogram_family(
            "modelprep_job_run_duration_seconds",
            "Time from start to end of finished jobs, by outcome.", "status", sums, "run_seconds",
        )
        queue_wait = HistogramMetricFamily(
            "modelprep_job_queue_wait_seconds", "Time jobs waited in the queue before starting."
        )
        buckets, total = totals.histogram(sums, "wait_seconds").get("", totals.EMPTY_HISTOGRAM)
        queue_wait.add_metric([], buckets, total)
        yield queue_wait
        for key, help_text in BYTE_COUNTERS.items():
            yield CounterMetricFamily(
                f"modelprep_job_{key}", help_text, value=sums.get((key, "", ""), 0.0)
            )
        yield CounterMetricFamily(
            "modelprep_download_cache_hits", "Sources served from the download cache.",
            value=sums.get(("cache_hits", "", ""), 0.0),
        )
        yield CounterMetricFamily(
            "modelprep_download_cache_misses", "Sources that had to be downloaded.",
            value=sums.get(("cache_misses", "", ""), 0.0),
        )
        yield GaugeMetricFamily(
            "modelprep_artifact_bytes",
            "Bytes of the artifacts of succeeded jobs whose files are still there.",
            value=sum(v for (name, _, _), v in sums.items() if name == totals.ARTIFACT_BYTES),
        )
        yield from self._callbacks(sums)
        yield from self._offload()
        yield from self._memory()

    def _memory(self) -> Iterator[Metric]:
        budget = self.settings.memory_budget
        limit = GaugeMetricFamily(
            "modelprep_memory_limit_bytes",
            "The memory limit the service lives under, by where it was read.", labels=["source"],
        )
        limit.add_metric([budget.limit_source], budget.limit)
        yield limit
        yield GaugeMetricFamily(
            "modelprep_memory_api_share_bytes",
            "Memory kept for the API process and the job forkserver.", value=budget.api_share,
        )
        yield GaugeMetricFamily(
            "modelprep_job_memory_budget_bytes",
            "Memory one job, with every child it starts, may use (MODELPREP_JOB_MEMORY).",
            value=budget.job,
        )

    def _callbacks(self, sums: dict[TotalKey, float]) -> Iterator[Metric]:
        attempts = sums.get(("callback_attempts", "", ""), 0.0)
        yield CounterMetricFamily(
            "modelprep_callback_attempts", "Completion callback POSTs whose outcome was "
            "recorded.", value=attempts,
        )
        ended = CounterMetricFamily(
            "modelprep_callbacks", "Completion callbacks that ended, by outcome.",
            labels=["outcome"],
        )
        for outcome in (CallbackState.DELIVERED, CallbackState.FAILED):
            ended.add_metric([outcome.value], sums.get(("callbacks", outcome.value, ""), 0.0))
        yield ended
        pending, lag = self.store.callback_backlog(utcnow())
        yield GaugeMetricFamily(
            "modelprep_callbacks_pending",
            "Completion callbacks of ended jobs not yet delivered nor failed.", value=pending,
        )
        yield GaugeMetricFamily(
            "modelprep_callback_lag_seconds",
            "How long the most overdue callback attempt has been due (0: none overdue); grows "
            "when no deliverer runs or all are busy.", value=lag,
        )

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
    name: str, help_text: str, label: str, sums: dict[TotalKey, float], key: str
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=[label])
    for value, (buckets, total) in totals.histogram(sums, key).items():
        family.add_metric([value], buckets, total)
    return family


def service_registry(store: JobStore, settings: Settings) -> CollectorRegistry:
    """The app's registry (not the process-global one: two apps in one process stay apart)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobStoreCollector(store, settings))
    return registry
