"""Artifact downloads: streamed from disk, with Range and a content-based ETag; or, for a job
published to the artifact store, a 307 redirect to a presigned URL of the object."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, RedirectResponse

from service.api.auth import PrincipalDep
from service.api.deps import JobsDep
from service.api.routes.jobs import PROBLEMS

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


@router.get(
    "/{job_id}/artifacts/{path:path}",
    responses={**PROBLEMS, 200: {"content": {"application/octet-stream": {}}}, 206: {}, 304: {},
               307: {"description": "Redirect to the object in the artifact store"},
               410: PROBLEMS[404]},
    response_class=FileResponse,
)
def download_artifact(
    job_id: str, path: str, jobs: JobsDep, principal: PrincipalDep, request: Request
) -> Response:
    url = jobs.artifact_url(job_id, path, principal.scope)
    if url is not None:  # in the artifact store: the client reads it there (Range, ETag)
        return RedirectResponse(url, status_code=307)
    job, file = jobs.artifact(job_id, path, principal.scope)
    digest = next((a.sha256 for a in job.artifacts if a.path == path), None)
    headers = {}
    if digest:
        etag = f'"{digest}"'
        headers["ETag"] = etag
        if request.headers.get("if-none-match") in (etag, "*"):
            return Response(status_code=304, headers=headers)
    return FileResponse(
        file, filename=file.name, media_type="application/octet-stream", headers=headers
    )
