"""Prometheus scrape endpoint: admin keys only, unless ``MODELPREP_METRICS_OPEN`` is set."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from service.api.auth import ScraperDep
from service.api.schemas import problems

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **problems(401, 403)},
)
def metrics(request: Request, _scraper: ScraperDep) -> Response:
    """Jobs by status and phase, phase durations, queue, bytes, offload disk, HTTP latency."""
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
