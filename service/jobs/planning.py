"""A job's plan from its spec: each export's formula over the source's headers, put together
against the job's memory budget and the data directory's free disk.

The headers come from the source (``SourceFetcher.headers``: a local directory's files, range
reads of an HTTP file or of a hub commit's shards; never the weights); the per-format formulas
are each format's own (``Exporter.plan``, through :func:`service.exporters.plan_export`);
:func:`service.plan.plan_job` decides whether it fits.
"""

from __future__ import annotations

import shutil

from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings
from service.exporters import plan_export
from service.jobs.spec import JobSpec
from service.plan import ExportPlan, JobPlan, plan_job
from service.sources import fetcher_for
from service.units import parse_size


def source_headers(spec: JobSpec, settings: Settings) -> CheckpointHeaders:
    """The job's checkpoint described from its headers (see :mod:`service.checkpoint.headers`)."""
    return fetcher_for(spec.source).headers(spec.source_request(), settings)


def plan_spec(spec: JobSpec, headers: CheckpointHeaders, settings: Settings) -> JobPlan:
    """Every export's plan and the job's, against ``settings.job_memory`` and the free disk
    of the data directory."""
    max_memory = parse_size(spec.max_memory or settings.offload_memory)
    exports: list[ExportPlan] = [
        plan_export(export, headers, max_memory, verify=spec.verify, settings=settings)
        for export in spec.export_specs()
    ]
    try:
        free: int | None = shutil.disk_usage(settings.data_dir).free
    except OSError:
        free = None  # not created yet: the job will say
    return plan_job(headers, exports, settings.job_memory, free)
