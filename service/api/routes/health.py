"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import JobsDep
from service.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
def readyz(jobs: JobsDep) -> JSONResponse:
    checks = jobs.readiness()
    ok = all(v == "ok" for v in checks.values())
    health = Health(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(health.model_dump(), status_code=200 if ok else 503)
