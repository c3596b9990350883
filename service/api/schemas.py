"""The wire contract of the HTTP API (v1). Field names here are the public promise."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.jobs.model import Job
from service.jobs.spec import JobSpec
from service.plan import JobPlan


class JobCreate(JobSpec):
    """A job: the checkpoint to fetch (`source`) and what to make of it (`exports`)."""

    dry_run: bool = Field(
        default=False,
        description="Plan the job instead of queueing it: answer 200 with its plan (peak "
        "memory of the job and of each child, disk, verification mode, whether it fits), "
        "made from the source's headers alone; no job is created.",
    )

    def spec(self) -> JobSpec:
        """The job's spec, without what only the request carries."""
        return JobSpec.model_validate(
            {**self.model_dump(exclude={"dry_run"}), "hf_token": self.hf_token}
        )


class ChildPlanOut(BaseModel):
    name: str = Field(description="onnxruntime, tract, llama-quantize, llama-perplexity...")
    peak_rss_bytes: int
    mapped_bytes: int = Field(
        description="Of its peak, read-only mapped file pages (weights): reclaimable page "
        "cache, not held against the budget."
    )


class ExportPlanOut(BaseModel):
    format: str
    job_peak_rss_bytes: int = Field(description="The job process's peak during this export.")
    job_rss_during_children_bytes: int
    group_peak_bytes: int = Field(
        description="The job's process group at its peak: the job, or the job beside its "
        "largest child."
    )
    budget_peak_bytes: int = Field(
        description="What the job's budget must hold: the group's peak less the children's "
        "read-only mapped file pages."
    )
    children: list[ChildPlanOut]
    verification: str = Field(
        description="whole, layerwise (the consumer runs the artifact whole or block by "
        "block), read_back, layout (GGUF), reference (safetensors), none."
    )
    artifact_bytes: int
    scratch_bytes: int
    offload_bytes: int
    notes: list[str] = Field(description="The formula and its terms, in words.")


class DiskPlanOut(BaseModel):
    download_bytes: int
    offload_bytes: int
    staging_bytes: int
    artifact_bytes: int
    total_bytes: int


class SourcePlanOut(BaseModel):
    format: str
    files: int
    weight_bytes: int
    download_bytes: int
    tensors: int
    largest_tensor: str | None
    largest_tensor_bytes: int


class PlanOut(BaseModel):
    """Answer of ``POST /v1/jobs`` with ``"dry_run": true``."""

    fits: bool = Field(description="Whether the job would be accepted on this service.")
    refusals: list[str] = Field(description="Why it would not, with the numbers.")
    peak_rss_bytes: int
    group_peak_bytes: int
    budget_peak_bytes: int = Field(description="What is compared with memory_budget_bytes.")
    memory_budget_bytes: int | None = Field(description="What one job may use.")
    disk_free_bytes: int | None
    disk: DiskPlanOut
    exports: list[ExportPlanOut]
    source: SourcePlanOut


def plan_out(plan: JobPlan) -> PlanOut:
    """The wire form of a job's plan."""
    body = plan.as_dict()
    headers = plan.headers
    largest = headers.largest()
    body["source"] = SourcePlanOut(
        format=headers.format, files=len(headers.files), weight_bytes=headers.weight_bytes,
        download_bytes=headers.download_bytes, tensors=len(headers.tensors),
        largest_tensor=largest.name if largest else None,
        largest_tensor_bytes=largest.nbytes if largest else 0,
    )  # fmt: skip
    return PlanOut.model_validate(body)


class ProgressOut(BaseModel):
    done: int
    total: int | None
    unit: str

    @classmethod
    def of(cls, job: Job) -> ProgressOut:
        return cls(done=job.progress.done, total=job.progress.total, unit=job.progress.unit)


class ErrorOut(BaseModel):
    type: str
    message: str

    @classmethod
    def of(cls, job: Job) -> ErrorOut | None:
        return None if job.error is None else cls(type=job.error.type, message=job.error.message)


class ArtifactOut(BaseModel):
    path: str
    size: int
    sha256: str
    url: str


class CallbackOut(BaseModel):
    """The job's completion callback and its delivery so far."""

    url: str
    state: str = Field(
        description="waiting (job not ended), pending (being delivered or waiting for a "
        "retry), delivered (2xx received), failed (attempts used up, or egress refused)."
    )
    attempts: int = Field(description="Attempts started so far.")
    next_attempt_at: datetime | None = Field(
        description="When the next attempt is due (pending only)."
    )
    last_status_code: int | None = Field(description="HTTP status of the last answer.")
    last_error: str | None = Field(description="Why the last attempt failed.")
    delivered_at: datetime | None


class JobOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    status: str
    phase: str
    progress: ProgressOut
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: ErrorOut | None
    artifacts: list[ArtifactOut]
    metrics: dict[str, Any]
    attempts: int
    cancel_requested: bool
    request: dict[str, Any] = Field(description="The job's spec as stored (never secrets).")
    tenant: str | None = Field(
        default=None, description="The tenant that submitted the job; null in open mode."
    )
    source: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    callback: CallbackOut | None = Field(
        default=None, description="Present when the job was submitted with a callback."
    )
    reused_from: str | None = Field(
        default=None,
        description="The job whose artifacts this one shares (same resolved source and recipe) "
        "instead of computing them; null when it computed them.",
    )

    @classmethod
    def from_job(cls, job: Job, base_path: str = "/v1/jobs") -> JobOut:
        # The details' sections, and the timeline and removal time (not declared fields:
        # present only once the job has them).
        sections: dict[str, Any] = dict(job.details)
        if job.phases:
            sections["phases"] = [entry.to_json() for entry in job.phases]
        if job.deleted_at is not None:
            sections["deleted_at"] = job.deleted_at.isoformat()
        return cls(
            id=job.id,
            status=job.status.value,
            phase=job.phase.value,
            progress=ProgressOut.of(job),
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            error=ErrorOut.of(job),
            artifacts=[
                ArtifactOut(
                    path=a.path,
                    size=a.size,
                    sha256=a.sha256,
                    url=f"{base_path}/{job.id}/artifacts/{a.path}",
                )
                for a in job.artifacts
            ],
            metrics=job.metrics,
            attempts=job.attempts,
            cancel_requested=job.cancel_requested,
            request=job.spec,
            tenant=job.tenant,
            callback=CallbackOut(
                url=job.callback.url,
                state=job.callback.state.value,
                attempts=job.callback.attempts,
                next_attempt_at=job.callback.next_attempt_at,
                last_status_code=job.callback.last_status_code,
                last_error=job.callback.last_error,
                delivered_at=job.callback.delivered_at,
            ) if job.callback is not None else None,
            reused_from=job.reused_from,
            **sections,
        )

    def json_bytes(self) -> bytes:
        """The document exactly as ``GET /v1/jobs/{id}`` serializes it (a callback's body)."""
        return self.model_dump_json().encode()


def job_json(job: Job) -> bytes:
    """The job's JSON document as the API gives it: the body of its completion callback."""
    return JobOut.from_job(job).json_bytes()


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None = Field(
        description="Pass as ?cursor= to get the next page; null on the last page."
    )


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[dict[str, Any]] | None = None


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for answers in problem+json with these statuses."""
    return {
        status: {"model": Problem, "content": {"application/problem+json": {}}}
        for status in statuses
    }


class MemoryReport(BaseModel):
    """The memory the service lives under and how it is shared among the API and the jobs."""

    limit_bytes: int = Field(description="The limit the service lives under.")
    limit_source: str = Field(
        description="Where it comes from: cgroup2:<file>, cgroup1:<dir>, host, or the setting."
    )
    api_share_bytes: int = Field(description="Kept for the API process and the job forkserver.")
    workers: int
    job_budget_bytes: int = Field(description="What one job, its children included, may use.")
    api_rss_bytes: int | None = Field(default=None, description="The API process's RSS now.")


class OutboundSetting(BaseModel):
    """Where one kind of outbound connection goes, and the variable that said so."""

    value: str = Field(description="The endpoint, region, proxy (no credentials) or CA "
                       "bundle in use; a token is only `set` or `none`.")
    source: str = Field(description="The variable it comes from (`MODELPREP_S3_ENDPOINT`, "
                        "`AWS_ENDPOINT_URL_S3`, `HTTPS_PROXY`...), or `default`.")


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)
    memory: MemoryReport | None = None
    outbound: dict[str, OutboundSetting] | None = Field(
        default=None, description="Object store, STS and hub endpoints, region, proxy and CA "
        "bundle in use, each with its source (docs/settings.md); never a secret.",
    )


class JobEvent(BaseModel):
    """``data`` of one ``GET /v1/jobs/{id}/events`` event; the SSE ``id`` is ``version``.

    The event name says what changed since the previous event of the stream: ``status`` (also
    the first event of a stream, and the last, with a terminal status), ``phase`` or
    ``progress``."""

    id: str
    version: int
    status: str
    phase: str
    progress: ProgressOut
    metrics: dict[str, Any]
    error: ErrorOut | None

    @classmethod
    def from_job(cls, job: Job) -> JobEvent:
        return cls(
            id=job.id,
            version=job.version,
            status=job.status.value,
            phase=job.phase.value,
            progress=ProgressOut.of(job),
            metrics=job.metrics,
            error=ErrorOut.of(job),
        )
