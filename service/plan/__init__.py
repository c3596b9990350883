"""A job's plan before it runs: peak memory of the job and of each child, disk, and whether it fits.

Made from the checkpoint's headers alone (:class:`service.checkpoint.headers.CheckpointHeaders`,
which every source builds without downloading the weights), by each format's own formula (the
``plan.py`` of its package, which its ``Exporter.plan`` declares: :mod:`service.exporters.base`)
over the terms every job shares (:mod:`service.plan.terms`), then put together here:

* each export: the job process's peak while it runs (``job_peak_rss_bytes``), each child it
  starts (llama-quantize, llama.cpp's checks, onnxruntime, tract) with its own peak, the
  verification mode, and the bytes it writes (staging, then artifacts, by one rename);
* the job: the largest of those, and the peak of its process group (the job process's
  resident memory while a child runs, plus that child), which is what a memory cgroup or
  the container's OOM killer sees; disk: the download, the offload store, everything staged.

``fits`` compares the group's peak with the job's memory budget and the disk with the free
space; a job that does not fit is refused at submission with both numbers
(:class:`service.errors.PlanDoesNotFit`).

This package knows no format: it never imports ``service.exporters``, whose formats import it.
A leaf: no torch; the API process plans.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings

VerificationMode = Literal["whole", "layerwise", "read_back", "reference", "layout", "none"]
"""How an export is checked: its consumer runs the whole artifact (``whole``) or block by block
(``layerwise``); GGUF reads every tensor back (``read_back``) or only its layout (``layout``);
safetensors is run by transformers against the source's reference outputs (``reference``)."""


@dataclass(frozen=True)
class ChildPlan:
    """A process the export starts, and the most memory it is expected to hold."""

    name: str
    """``onnxruntime``, ``tract``, ``llama-quantize``, ``llama-perplexity``..."""
    peak_rss_bytes: int
    mapped_bytes: int = 0
    """Of ``peak_rss_bytes``, the pages of files it memory-maps read-only (onnxruntime's
    weights, llama.cpp's GGUF): page cache the kernel reclaims within a memory cgroup's limit
    rather than fail, so they are not held against the budget."""


@dataclass(frozen=True)
class PlanInputs:
    """What an export's formula is given besides its spec: the same for every export of a job."""

    headers: CheckpointHeaders
    """The checkpoint as its headers describe it (no weight read)."""
    max_memory: int
    """The job's RAM budget for a model's weights (``max_memory``), in bytes."""
    verify: bool = True
    """The job's ``"verify"``; when False, every spec's own ``verify`` is already False too."""
    settings: Settings | None = None
    """The service's, for what a format's consumer may hold (``tract_max_memory``...); None:
    no such limit."""


@dataclass(frozen=True)
class ExportPlan:
    format: str
    job_peak_rss_bytes: int
    """The job process's peak while this export runs (shared phases included)."""
    job_rss_during_children_bytes: int
    """The job process's resident memory while a child runs (children start after the
    export's own buffers are freed)."""
    children: tuple[ChildPlan, ...] = ()
    verification: VerificationMode = "none"
    artifact_bytes: int = 0
    """Bytes of the files this export leaves in the job's artifacts."""
    scratch_bytes: int = 0
    """Bytes written in the work directory beside the artifacts and removed before the job
    ends (llama-quantize's f16 input)."""
    offload_bytes: int = 0
    """Bytes written into the job's offload store for this export (weights a safetensors
    source references in place cost nothing)."""
    notes: tuple[str, ...] = ()
    """How the figures were derived, in words (the largest tensor, the formula's terms)."""
    job_shared_bytes: int = 0
    """Of the job process's resident memory, the pages it still shares with the forkserver it
    was forked from (the preloaded libraries): charged to the service's cgroup before the job
    began, and left out of the pool's own accounting (``memory.process_group_private_bytes``),
    so not held against the job's budget."""

    @property
    def group_peak_bytes(self) -> int:
        """The process group's peak: the job alone, or the job beside its largest child."""
        child = max((c.peak_rss_bytes for c in self.children), default=0)
        return max(self.job_peak_rss_bytes, self.job_rss_during_children_bytes + child)

    @property
    def budget_peak_bytes(self) -> int:
        """What the job's budget must hold at the group's peak: ``group_peak_bytes`` less the
        pages the job shares with the forkserver and the children's read-only mapped file
        pages (reclaimable page cache)."""
        child = max((c.peak_rss_bytes - c.mapped_bytes for c in self.children), default=0)
        job = max(self.job_peak_rss_bytes, self.job_rss_during_children_bytes + child)
        return job - self.job_shared_bytes


@dataclass(frozen=True)
class DiskPlan:
    download_bytes: int
    offload_bytes: int
    staging_bytes: int
    """Every export's files (renamed into the artifacts at the end: no second copy) plus the
    largest scratch file."""
    artifact_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.download_bytes + self.offload_bytes + self.staging_bytes


@dataclass(frozen=True)
class JobPlan:
    headers: CheckpointHeaders
    """What the plan was made from."""
    exports: tuple[ExportPlan, ...]
    peak_rss_bytes: int
    """The job's ``peak_rss_bytes`` metric as the job records it: the job process's peak or
    its largest child's, whichever is larger."""
    group_peak_bytes: int
    """The job's process group at its peak (resident pages, mapped files included)."""
    budget_peak_bytes: int
    """What the memory budget is compared with: the group's peak less the children's
    read-only mapped file pages (:attr:`ExportPlan.budget_peak_bytes`)."""
    disk: DiskPlan
    memory_budget_bytes: int | None
    disk_free_bytes: int | None
    refusals: tuple[str, ...] = field(default=())
    """Why the job does not fit, one sentence per reason, numbers named; empty when it fits."""

    @property
    def fits(self) -> bool:
        return not self.refusals

    def as_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready (the headers it was made from left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "headers"}
        out["exports"] = [asdict(e) | {"group_peak_bytes": e.group_peak_bytes,
                                       "budget_peak_bytes": e.budget_peak_bytes}
                          for e in self.exports]  # fmt: skip
        out["disk"] = asdict(self.disk)
        out["disk"]["total_bytes"] = self.disk.total_bytes
        out["fits"] = self.fits
        return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_job(
    headers: CheckpointHeaders,
    exports: list[ExportPlan],
    memory_budget_bytes: int | None,
    disk_free_bytes: int | None,
) -> JobPlan:
    """Put the exports' plans together: exports run one after the other in one process and
    share the download and the offload store; staged files stay until the job ends. A budget
    or free space of None is not checked."""
    peak = max(
        max([e.job_peak_rss_bytes, *(c.peak_rss_bytes for c in e.children)]) for e in exports
    )
    group = max(e.group_peak_bytes for e in exports)
    budget = max(e.budget_peak_bytes for e in exports)
    artifacts = sum(e.artifact_bytes for e in exports)
    disk = DiskPlan(
        download_bytes=headers.download_bytes,
        offload_bytes=max(e.offload_bytes for e in exports),
        staging_bytes=artifacts + max(e.scratch_bytes for e in exports),
        artifact_bytes=artifacts,
    )
    refusals: list[str] = []
    if memory_budget_bytes is not None and budget > memory_budget_bytes:
        worst = max(exports, key=lambda e: e.budget_peak_bytes)
        who = ", ".join(
            f"{c.name} {_gib(c.peak_rss_bytes - c.mapped_bytes)}" for c in worst.children
        ) or "no child"
        refusals.append(
            f"the job needs about {_gib(budget)} of memory at its peak ({worst.format} export: "
            f"job process {_gib(worst.job_peak_rss_bytes)}, {who}), more than the "
            f"{_gib(memory_budget_bytes)} budget of a job (MODELPREP_JOB_MEMORY)"
        )
    if disk_free_bytes is not None and disk.total_bytes > disk_free_bytes:
        refusals.append(
            f"the job needs about {_gib(disk.total_bytes)} of disk (download "
            f"{_gib(disk.download_bytes)}, offload {_gib(disk.offload_bytes)}, staging "
            f"{_gib(disk.staging_bytes)}), more than the {_gib(disk_free_bytes)} free in the "
            "data directory"
        )
    return JobPlan(
        headers=headers,
        exports=tuple(exports),
        peak_rss_bytes=peak,
        group_peak_bytes=group,
        budget_peak_bytes=budget,
        disk=disk,
        memory_budget_bytes=memory_budget_bytes,
        disk_free_bytes=disk_free_bytes,
        refusals=tuple(refusals),
    )
