"""The service's running totals: what ended jobs add up to, kept in the store (``job_totals``).

Why a table of totals rather than reading jobs: ``/metrics`` and the tenant artifact-bytes
limit must cost the same with a hundred jobs in the store as with a million. A job adds its
figures once, in the transaction that moves it to a terminal status
(:func:`service.jobs.store.lifecycle.finish`), and removes its artifact bytes in the one that
removes its files (``mark_deleted``). A reader then reads a few hundred rows, whatever the
number of jobs; the API process keeps nothing per job.

One row per ``(name, label, bucket)``, ``value`` a double (exact for integers below 2**53,
i.e. 8 PiB of bytes):

==========================  ===========  ==================  ===================================
name                        label        bucket              value
==========================  ===========  ==================  ===================================
``phase_seconds``           phase        a bound, ``+Inf``,  histogram of finished jobs' phases:
                                         or ``sum``          count per bucket (not cumulative)
``run_seconds``             status       same                start-to-end time by outcome
``wait_seconds``            ``""``       same                queued-to-started time
``bytes_read`` ...          ``""``       ``""``              the job metrics of BYTE_COUNTERS
``cache_hits`` / _misses    ``""``       ``""``              sources served from the cache or not
``artifact_bytes``          tenant       ``""``              live artifact bytes of succeeded jobs
                            (``""``: open mode)              (down again when files are removed)
``callback_attempts``       ``""``       ``""``              completion callback attempts made
``callbacks``               outcome      ``""``              callbacks delivered / failed
==========================  ===========  ==================  ===================================

Bucket counts are stored per bound, not cumulative, and a reader cumulates over the bounds it
finds: changing :data:`PHASE_BUCKETS` later leaves old counts at their old bounds rather than
corrupting them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from service.jobs.model import CallbackState, Job, JobStatus

PHASE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                 3600.0, 7200.0, 21600.0, 86400.0)
BYTE_COUNTERS = {
    "bytes_read": "Bytes read from checkpoints by jobs.",
    "bytes_written": "Bytes written to artifacts by jobs.",
    "bytes_downloaded": "Bytes downloaded from sources by jobs (cache misses).",
    "artifact_bytes_freed": "Bytes of finished jobs' files removed (DELETE, retention).",
}
ARTIFACT_BYTES = "artifact_bytes"
FREED = "artifact_bytes_freed"
SUM = "sum"

TotalKey = tuple[str, str, str]
"""(name, label, bucket) of one row of ``job_totals``."""


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start and end else None


def _bucket(value: float) -> str:
    bound = next((b for b in PHASE_BUCKETS if value <= b), None)
    return "+Inf" if bound is None else str(bound)


def _observe(out: dict[TotalKey, float], name: str, label: str, value: float) -> None:
    for key, add in (((name, label, _bucket(value)), 1.0), ((name, label, SUM), value)):
        out[key] = out.get(key, 0.0) + add


def running_figures(job: Job) -> dict[TotalKey, float]:
    """What a job contributes while it runs: its wait, its byte counts so far, its cache use.

    The counters of ``/metrics`` include running jobs' latest reports, so that a long
    download shows while it happens."""
    out: dict[TotalKey, float] = {}
    wait = _seconds(job.created_at, job.started_at)
    if wait is not None:
        _observe(out, "wait_seconds", "", wait)
    for key in BYTE_COUNTERS.keys() - {FREED}:  # freed: added when the files go
        value = job.metrics.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[(key, "", "")] = float(value)
    hit = job.metrics.get("cache_hit")
    if isinstance(hit, bool):
        out[("cache_hits" if hit else "cache_misses", "", "")] = 1.0
    return out


def ended_figures(job: Job) -> dict[TotalKey, float]:
    """What a job adds to the totals when it reaches a terminal status (once)."""
    assert job.status.terminal
    out = running_figures(job)
    for entry in job.phases:
        if entry.seconds is not None:
            _observe(out, "phase_seconds", entry.phase.value, entry.seconds)
    run = _seconds(job.started_at, job.finished_at)
    if run is not None:
        _observe(out, "run_seconds", job.status.value, run)
    if job.status is JobStatus.SUCCEEDED and job.deleted_at is None:
        out[(ARTIFACT_BYTES, job.tenant or "", "")] = float(artifact_bytes(job))
    return out


def artifact_bytes(job: Job) -> int:
    """The bytes of a job's artifacts, as listed on the job."""
    return sum(a.size for a in job.artifacts)


def callback_figures(state: CallbackState) -> dict[TotalKey, float]:
    """What one recorded callback attempt adds (recorded with it, in its transaction)."""
    figures: dict[TotalKey, float] = {("callback_attempts", "", ""): 1.0}
    if state in (CallbackState.DELIVERED, CallbackState.FAILED):
        figures[("callbacks", state.value, "")] = 1.0
    return figures


def add(into: dict[TotalKey, float], more: Mapping[TotalKey, float]) -> None:
    """Add ``more`` to ``into``, key by key."""
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value


Histogram = tuple[list[tuple[str, float]], float]
"""(cumulative buckets as Prometheus wants them, sum of the observations)."""


def histogram(rows: Mapping[TotalKey, float], name: str) -> dict[str, Histogram]:
    """Label -> histogram of the histogram rows ``name`` of the totals."""
    counts: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for (row_name, label, bucket), value in rows.items():
        if row_name != name:
            continue
        if bucket == SUM:
            sums[label] = sums.get(label, 0.0) + value
        else:
            per = counts.setdefault(label, {})
            bound = float("inf") if bucket == "+Inf" else float(bucket)
            per[bound] = per.get(bound, 0.0) + value
    return {
        label: (_cumulative(counts.get(label, {})), sums.get(label, 0.0))
        for label in sorted(set(counts) | set(sums))
    }


def _cumulative(per_bound: Mapping[float, float]) -> list[tuple[str, float]]:
    running, buckets = 0.0, []
    for bound in sorted(set(PHASE_BUCKETS) | set(per_bound) | {float("inf")}):
        running += per_bound.get(bound, 0.0)
        buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
    return buckets


EMPTY_HISTOGRAM: Histogram = (_cumulative({}), 0.0)


def merged(groups: Iterable[Mapping[TotalKey, float]]) -> dict[TotalKey, float]:
    """The sum of several maps of totals."""
    out: dict[TotalKey, float] = {}
    for group in groups:
        add(out, group)
    return out
