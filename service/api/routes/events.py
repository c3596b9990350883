"""Live progress of a job as Server-Sent Events, resumable with ``Last-Event-ID``.

The job row's ``version`` grows with every change, so it is the event id: the stream follows
the job through the process's :class:`~service.api.watch.JobWatch` (one poll of the store every
``POLL_SECONDS`` for all streams), emits the job's state whenever its version is newer than the
last one sent, and ends after the event carrying a terminal status. A client that reconnects
with ``Last-Event-ID: v`` gets the current state at once if it changed after ``v``, nothing
missed in between matters because each event is the whole state, not a delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated

from fastapi import APIRouter, Header
from sse_starlette import EventSourceResponse, ServerSentEvent

from service.api.auth import PrincipalDep
from service.api.deps import JobsDep, WatchDep
from service.api.routes.jobs import PROBLEMS
from service.api.schemas import JobEvent
from service.api.watch import JobWatch
from service.jobs.model import Job

router = APIRouter(prefix="/v1/jobs", tags=["events"])

PING_SECONDS = 15


def _kind(previous: Job | None, job: Job) -> str:
    if previous is None or previous.status is not job.status:
        return "status"
    if previous.phase is not job.phase:
        return "phase"
    return "progress"


async def _stream(watch: JobWatch, job: Job, seen: int) -> AsyncIterator[ServerSentEvent]:
    previous: Job | None = None
    async with aclosing(watch.follow(job)) as states:  # unfollow as soon as the stream ends
        async for state in states:
            if state.version > seen:
                yield ServerSentEvent(
                    data=JobEvent.from_job(state).model_dump_json(),
                    event=_kind(previous, state),
                    id=str(state.version),
                )
                seen, previous = state.version, state


@router.get(
    "/{job_id}/events",
    responses={**PROBLEMS, 200: {"content": {"text/event-stream": {}},
                                 "description": "JobEvent objects as Server-Sent Events"}},
    response_class=EventSourceResponse,
)
async def job_events(
    job_id: str,
    jobs: JobsDep,
    watch: WatchDep,
    principal: PrincipalDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventSourceResponse:
    """Stream the job's state changes until it ends; another tenant's job answers 404."""
    job = await jobs.get_on_loop(job_id, principal.scope)
    seen = int(last_event_id) if last_event_id and last_event_id.isdigit() else -1
    return EventSourceResponse(_stream(watch, job, seen), ping=PING_SECONDS)
