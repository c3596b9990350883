"""Request telemetry: a request id, a latency histogram and one JSON access-log line per request.

A pure ASGI middleware rather than ``BaseHTTPMiddleware``, so streamed responses (artifact
downloads, the events stream) pass through untouched. Latency is measured to the start of the
response (status and headers sent): for a stream that is what a client waits for, and the
stream's own length would only drown the figure. The access line records the whole duration.

Only the method, the path (no query string), the status, timings, the tenant and the request id
are logged: never a header, so an ``Authorization`` key cannot reach the logs.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.logs import request_id

log = logging.getLogger("service.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_QUIET_PATHS = {"/healthz", "/readyz", "/metrics"}
"""Probes and scrapes come every few seconds: logged at DEBUG, not INFO."""

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


def request_latency_histogram(registry: CollectorRegistry) -> Histogram:
    """The HTTP latency histogram, registered in the app's own registry."""
    return Histogram(
        "modelprep_http_request_duration_seconds",
        "Time from receiving an HTTP request to sending its response status, by route.",
        ["method", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )


def _route_template(scope: Scope) -> str:
    """The matched route's path template (bounded label values), or ``unmatched``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class RequestTelemetry:
    """Tags each request with an id (``X-Request-ID``, accepted from the caller when sane),
    observes its latency and writes its access-log line."""

    def __init__(self, app: ASGIApp, latency: Histogram) -> None:
        self.app = app
        self.latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
        token = request_id.set(rid)
        started = time.perf_counter()
        state: dict[str, Any] = {"status": 500, "first_byte": None}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                state["first_byte"] = time.perf_counter() - started
                MutableHeaders(scope=message).append("X-Request-ID", rid)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, rid, started, state)
            request_id.reset(token)

    def _record(self, scope: Scope, rid: str, started: float, state: dict[str, Any]) -> None:
        total = time.perf_counter() - started
        first_byte = state["first_byte"] if state["first_byte"] is not None else total
        route = _route_template(scope)
        method = scope.get("method", "")
        status = state["status"]
        self.latency.labels(method, route, str(status)).observe(first_byte)
        principal = scope.get("state", {}).get("principal")
        path = scope.get("path", "")
        log.log(
            logging.DEBUG if path in _QUIET_PATHS else logging.INFO,
            "%s %s %s",
            method,
            path,
            status,
            extra={
                "request_id": rid,
                "method": method,
                "path": path,
                "route": route,
                "status": status,
                "ms": round(total * 1000, 2),
                "ttfb_ms": round(first_byte * 1000, 2),
                "tenant": getattr(principal, "tenant", None),
            },
        )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None
