"""Jobs: submit, inspect, list, cancel."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Response, status
from fastapi.responses import JSONResponse

from service.api.auth import PrincipalDep
from service.api.deps import JobsDep
from service.api.schemas import JobCreate, JobOut, JobPage, PlanOut, plan_out, problems
from service.jobs.model import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

PROBLEMS = problems(400, 401, 404, 409, 422, 429)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
CURSOR_PATTERN = r"^[0-9]{1,17}\.[0-9A-Za-z_-]{1,36}$"
"""``<microseconds since 1970 of the last job's created_at>.<its id>``: every string the
pattern allows is a cursor the route can use (17 digits stay below year 9999), so the schema
and the route agree on what a cursor is."""


def _encode_cursor(created_at: datetime, job_id: str) -> str:
    return f"{(created_at - _EPOCH) // timedelta(microseconds=1)}.{job_id}"


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    micros, job_id = cursor.split(".", 1)  # the pattern has been checked
    return _EPOCH + timedelta(microseconds=int(micros)), job_id


_SOURCE = "file:///srv/models/tiny-llama"

SUBMIT_EXAMPLES: dict[str, dict[str, Any]] = {
    "safetensors": {
        "summary": "safetensors, cast to bfloat16, in shards of at most 5 GB",
        "value": {"source": _SOURCE, "exports": [
            {"format": "safetensors", "dtype": "bfloat16", "max_shard_size": "5GB"}]},
    },
    "gguf": {
        "summary": "GGUF for llama.cpp, Q4_K_M (llama-quantize's mixture)",
        "value": {"source": "file:///srv/models/smollm2-135m",
                  "exports": [{"format": "gguf", "type": "Q4_K_M"}]},
    },
    "nnef": {
        "summary": "NNEF archive for tract, 4-bit weights",
        "value": {"source": _SOURCE, "exports": [{"format": "nnef", "compression": "q4_0"}]},
    },
    "onnx": {
        "summary": "ONNX with a KV cache (optimum's layout), float32",
        "value": {"source": _SOURCE, "exports": [
            {"format": "onnx", "dtype": "float32", "task": "text-generation-with-past"}]},
    },
    "several": {
        "summary": "several exports of one download, a memory budget, a completion callback",
        "value": {"source": "https://models.example.com/tiny/model.safetensors",
                  "sha256": "0" * 64, "max_memory": "1GiB",
                  "exports": [{"format": "safetensors"}, {"format": "gguf", "type": "q8_0"}],
                  "callback": {"url": "https://platform.example.com/hooks/modelprep"}},
    },
}
"""One request body per format, shown by /docs."""


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobOut,
    responses={
        **PROBLEMS, **problems(415, 503),
        200: {"model": PlanOut, "description": '"dry_run": true: the job\'s plan; no job.'},
    },
    summary="Submit a job",
)  # fmt: skip
def submit_job(
    body: Annotated[JobCreate, Body(openapi_examples=SUBMIT_EXAMPLES)],
    jobs: JobsDep,
    principal: PrincipalDep,
    response: Response,
) -> JobOut | JSONResponse:
    """Queue a job that fetches `source` and makes each of `exports`; `202` with the job
    and its `Location`. What can be known now is refused now (`422`: a source outside the
    allowed roots, an unknown format, dtype or type, each named with the accepted values);
    `429` with `Retry-After` when the queue or the tenant's limits are full. Follow the job
    with `GET /v1/jobs/{id}` or its `/events` stream; download what its `artifacts`
    list once it `succeeded`. With `"dry_run": true`, `200` with the job's plan (predicted
    peak memory of the job and each child, disk, verification mode, whether it fits) and no
    job; a local job whose plan does not fit is refused `422 plan_does_not_fit`."""
    if body.dry_run:
        plan = jobs.plan(body.spec(), tenant=principal.tenant)
        return JSONResponse(plan_out(plan).model_dump(mode="json"))
    job = jobs.submit(body.spec(), tenant=principal.tenant)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.from_job(job)


@router.get("", responses=PROBLEMS)
def list_jobs(
    jobs: JobsDep,
    principal: PrincipalDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None,
        Query(pattern=CURSOR_PATTERN, description="next_cursor of the previous page"),
    ] = None,
) -> JobPage:
    before = _decode_cursor(cursor) if cursor else None
    page = jobs.page(status, limit, before, tenant=principal.scope)
    next_cursor = (
        _encode_cursor(page[-1].created_at, page[-1].id) if len(page) == limit else None
    )
    return JobPage(items=[JobOut.from_job(j) for j in page], next_cursor=next_cursor)


@router.get("/{job_id}", responses=PROBLEMS)
async def get_job(job_id: str, jobs: JobsDep, principal: PrincipalDep) -> JobOut:
    return JobOut.from_job(await jobs.get_on_loop(job_id, principal.scope))


@router.post(
    "/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, responses=PROBLEMS,
    summary="Cancel a queued or running job",
)
def cancel_job(job_id: str, jobs: JobsDep, principal: PrincipalDep) -> JobOut:
    """Cancel a queued job at once, or ask a running one to stop (`cancel_requested`; its
    process group is killed and its files removed). A finished job answers `409 conflict`
    and keeps its files: `DELETE` removes them."""
    return JobOut.from_job(jobs.cancel(job_id, principal.scope))


@router.delete(
    "/{job_id}",
    status_code=status.HTTP_202_ACCEPTED,
    responses={**PROBLEMS, 200: {"model": JobOut, "description": "A finished job: its "
                                 "artifacts and work files are removed; the job stays."}},
)
def delete_job(
    job_id: str, jobs: JobsDep, principal: PrincipalDep, response: Response
) -> JobOut:
    """Cancel a queued or running job (202); remove a finished job's files (200)."""
    job = jobs.delete(job_id, principal.scope)
    if job.deleted_at is not None:
        response.status_code = status.HTTP_200_OK
    return JobOut.from_job(job)
