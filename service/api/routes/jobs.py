"""Jobs: submit, inspect, list, cancel."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from starlette.concurrency import run_in_threadpool

from service.api.auth import PrincipalDep
from service.api.deps import JobsDep
from service.api.schemas import JobCreate, JobOut, JobPage, Problem
from service.errors import InvalidRequest
from service.jobs.model import Job, JobStatus
from service.jobs.service import JobService

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

PROBLEMS: dict[int | str, dict[str, object]] = {
    code: {"model": Problem, "content": {"application/problem+json": {}}}
    for code in (400, 401, 404, 409, 422, 429)
}


def _encode_cursor(created_at: datetime, job_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{job_id}".encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, job_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        return datetime.fromisoformat(created), job_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("invalid cursor") from exc


async def fetch_job(jobs: JobService, job_id: str, tenant: str | None) -> Job:
    """``jobs.get`` for a route on the event loop.

    Inline when the store's reads never wait (SQLite): a point read costs less than a hop to the
    thread pool, which on a busy machine also costs two thread wake-ups and GIL hand-overs per
    request (bench/api_latency.py). In the thread pool otherwise: a network database may stall,
    and the event loop must not stall with it."""
    if jobs.store.reads_never_wait:
        return jobs.get(job_id, tenant)
    return await run_in_threadpool(jobs.get, job_id, tenant)


@router.post("", status_code=status.HTTP_202_ACCEPTED, responses=PROBLEMS)
def submit_job(
    body: JobCreate, jobs: JobsDep, principal: PrincipalDep, response: Response
) -> JobOut:
    job = jobs.submit(body, tenant=principal.tenant)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.from_job(job)


@router.get("", responses=PROBLEMS)
def list_jobs(
    jobs: JobsDep,
    principal: PrincipalDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> JobPage:
    before = _decode_cursor(cursor) if cursor else None
    page = jobs.page(status, limit, before, tenant=principal.scope)
    next_cursor = (
        _encode_cursor(page[-1].created_at, page[-1].id) if len(page) == limit else None
    )
    return JobPage(items=[JobOut.from_job(j) for j in page], next_cursor=next_cursor)


@router.get("/{job_id}", responses=PROBLEMS)
async def get_job(job_id: str, jobs: JobsDep, principal: PrincipalDep) -> JobOut:
    return JobOut.from_job(await fetch_job(jobs, job_id, principal.scope))


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
    if "deleted_at" in job.details:
        response.status_code = status.HTTP_200_OK
    return JobOut.from_job(job)
