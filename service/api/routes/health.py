"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from service.api.deps import JobsDep
from service.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
def readyz(jobs: JobsDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        with jobs.store.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - readiness reports any failure, never raises
        checks["database"] = f"error: {type(exc).__name__}"
    data_dir = jobs.settings.data_dir
    checks["data_dir"] = "ok" if data_dir.is_dir() else "missing"
    ok = all(v == "ok" for v in checks.values())
    health = Health(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(health.model_dump(), status_code=200 if ok else 503)
