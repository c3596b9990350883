"""A job's plan from its spec: each export's formula over the source's headers, put together
against the job's memory budget and the data directory's free disk.

The headers come from the source (``SourceFetcher.headers``: a local directory's files, range
reads of an HTTP file or of a hub commit's shards; never the weights); the per-format formulas
are :mod:`service.plan.formats`; :func:`service.plan.plan_job` decides whether it fits.
"""

from __future__ import annotations

import shutil

from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings
from service.jobs.spec import JobSpec
from service.plan import ExportPlan, JobPlan, plan_job
from service.plan.formats import plan_export
from service.sources import fetcher_for
from service.units import parse_size


def source_headers(spec: JobSpec, settings: Settings) -> CheckpointHeaders:
    """The job's checkpoint described from its headers (see :mod:`service.checkpoint.headers`)."""
    return fetcher_for(spec.source).headers(spec.source_request(), settings)


def plan_spec(spec: JobSpec, headers: CheckpointHeaders, settings: Settings) -> JobPlan:
    """Every export's plan and the job's, against ``settings.job_memory`` and the free disk
    of the data directory."""
    max_memory = parse_size(spec.max_memory or settings.offload_memory)
    tract_limit = parse_size(settings.tract_max_memory) if settings.tract_max_memory else None
    exports: list[ExportPlan] = [
        plan_export(export, headers, max_memory, verify=spec.verify, tract_limit=tract_limit)
        for export in spec.export_specs()
    ]
    try:
        free: int | None = shutil.disk_usage(settings.data_dir).free
    except OSError:
        free = None  # not created yet: the job will say
    return plan_job(headers, exports, settings.job_memory, free)
