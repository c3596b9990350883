"""Live progress of a job as Server-Sent Events, resumable with ``Last-Event-ID``.

The job row's ``version`` grows with every change, so it is the event id: the stream polls the
store (every ``POLL_SECONDS``), emits the job's state whenever its version is newer than the
last one sent, and ends after the event carrying a terminal status. A client that reconnects
with ``Last-Event-ID: v`` gets the current state at once if it changed after ``v``, nothing
missed in between matters because each event is the whole state, not a delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Header
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from service.api.auth import PrincipalDep
from service.api.deps import JobsDep
from service.api.routes.jobs import PROBLEMS
from service.api.schemas import JobEvent
from service.errors import JobNotFound
from service.jobs.model import Job
from service.jobs.service import JobService

router = APIRouter(prefix="/v1/jobs", tags=["events"])

POLL_SECONDS = 0.2
PING_SECONDS = 15


def _kind(previous: Job | None, job: Job) -> str:
    if previous is None or previous.status is not job.status:
        return "status"
    if previous.phase is not job.phase:
        return "phase"
    return "progress"


async def _stream(jobs: JobService, job: Job, tenant: str | None, seen: int) -> AsyncIterator[
    ServerSentEvent
]:
    previous: Job | None = None
    while True:
        if job.version > seen:
            yield ServerSentEvent(
                data=JobEvent.from_job(job).model_dump_json(),
                event=_kind(previous, job),
                id=str(job.version),
            )
            seen, previous = job.version, job
        if job.status.terminal:
            return
        await anyio.sleep(POLL_SECONDS)
        try:
            job = await run_in_threadpool(jobs.get, job.id, tenant)
        except JobNotFound:
            return


@router.get(
    "/{job_id}/events",
    responses={**PROBLEMS, 200: {"content": {"text/event-stream": {}},
                                 "description": "JobEvent objects as Server-Sent Events"}},
    response_class=EventSourceResponse,
)
async def job_events(
    job_id: str,
    jobs: JobsDep,
    principal: PrincipalDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventSourceResponse:
    """Stream the job's state changes until it ends; another tenant's job answers 404."""
    job = await run_in_threadpool(jobs.get, job_id, principal.scope)
    seen = int(last_event_id) if last_event_id and last_event_id.isdigit() else -1
    return EventSourceResponse(_stream(jobs, job, principal.scope, seen), ping=PING_SECONDS)
