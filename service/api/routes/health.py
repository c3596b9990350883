"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import JobsDep
from service.api.schemas import Health, MemoryReport, OutboundSetting
from service.config import Settings
from service.memory import current_rss
from service.objectstore import outbound_report

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
def readyz(jobs: JobsDep) -> JSONResponse:
    checks = jobs.readiness()
    ok = all(v == "ok" for v in checks.values())
    health = Health(
        status="ok" if ok else "unavailable", checks=checks, memory=memory_report(jobs.settings),
        outbound={name: OutboundSetting(**entry)
                  for name, entry in outbound_report(jobs.settings).items()},
    )
    return JSONResponse(health.model_dump(), status_code=200 if ok else 503)


def memory_report(settings: Settings) -> MemoryReport:
    budget = settings.memory_budget
    return MemoryReport(
        limit_bytes=budget.limit, limit_source=budget.limit_source,
        api_share_bytes=budget.api_share, workers=budget.workers, job_budget_bytes=budget.job,
        api_rss_bytes=current_rss(),
    )  # fmt: skip
