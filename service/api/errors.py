"""The one place where errors become HTTP: RFC 9457 ``application/problem+json`` for all."""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from service.errors import (
    AdapterError,
    ArtifactGone,
    CheckpointError,
    Conflict,
    EgressRefused,
    Forbidden,
    InvalidRequest,
    MemoryBudgetExceeded,
    NotFound,
    PathOutsideRoot,
    QueueFull,
    ServiceError,
    SourceError,
    SourceNotAllowed,
    SourceNotFound,
    ToolMissing,
    Unauthorized,
    UnsupportedQuantization,
    VerificationTooLarge,
)

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
TYPE_BASE = "/problems/"
"""Problem ``type`` URIs are this service's own ``/problems/<code>`` pages (a reference
relative to the request's URL, as RFC 9457 allows): see ``service.api.problems``."""

HTTP_STATUS: dict[type[ServiceError], int] = {
    InvalidRequest: 422,
    NotFound: 404,
    ArtifactGone: 410,  # removed by DELETE or retention: not coming back
    Conflict: 409,
    QueueFull: 429,  # TenantLimitExceeded too
    Unauthorized: 401,
    PathOutsideRoot: 403,
    Forbidden: 403,
    SourceError: 422,
    SourceNotAllowed: 422,  # before PermissionError-derived 403s in the MRO: a request fault
    SourceNotFound: 422,
    EgressRefused: 422,
    CheckpointError: 422,
    AdapterError: 422,  # the adapter does not fit the source: a request fault
    UnsupportedQuantization: 422,  # a request fault: the readers implement a list of methods
    ToolMissing: 503,  # a deployment fault (llama.cpp not built here), not the request's
    # Refused at submission: what was asked cannot fit the memory one job has here.
    VerificationTooLarge: 422,
    MemoryBudgetExceeded: 422,
}
"""The HTTP status of each domain error; a class not listed takes its nearest listed base's
(the method resolution order decides), an error with none is a 500."""


def http_status(exc: ServiceError | type[ServiceError]) -> int:
    """The HTTP status an error (or error class) maps to (see :data:`HTTP_STATUS`)."""
    kind = exc if isinstance(exc, type) else type(exc)
    for cls in kind.__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500


def closest(value: object, options: Sequence[str]) -> str | None:
    """The option a mistyped ``value`` most likely meant (case, ``_`` and ``-`` ignored
    first, then by similarity), or None."""
    if not isinstance(value, str) or not options:
        return None

    def norm(text: str) -> str:
        return re.sub(r"[_\-\s]", "", text.lower())

    for option in options:
        if norm(option) == norm(value):
            return option
    by_norm = {norm(o): o for o in options}
    match = difflib.get_close_matches(norm(value), list(by_norm), n=1, cutoff=0.6)
    return by_norm[match[0]] if match else None


def _field_path(loc: Sequence[Any], tags: frozenset[str]) -> str:
    """``exports[0].type`` for pydantic's ``("body", "exports", 0, "gguf", "type",
    "literal['f32',...]")``: the request part, union tags and type names are dropped."""
    out = ""
    previous: Any = None
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(previous, int) and part in tags:
            pass  # the discriminated union's tag: the format the item claims
        elif re.search(r"[\[(]", str(part)) or str(part) in ("str", "int", "float", "bool"):
            pass  # a union member's type name
        else:
            out += f".{part}" if out else str(part)
        previous = part
    return out or "body"


def readable_errors(errors: Sequence[dict[str, Any]], tags: frozenset[str]) -> str:
    """One line per field a request got wrong: its path, what it accepts, what was sent and,
    for a choice among names, the closest valid one (``did you mean 'Q4_K_M'?``)."""
    by_path: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        by_path.setdefault(_field_path(err.get("loc", ()), tags), []).append(err)
    lines = []
    for path, errs in by_path.items():
        options: list[str] = []
        for err in errs:
            ctx = err.get("ctx") or {}
            if err.get("type") == "literal_error":
                options += re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
            elif err.get("type") == "union_tag_invalid":
                options += re.findall(r"'([^']*)'", str(ctx.get("expected_tags", "")))
                path = f"{path}.format" if not path.endswith("format") else path
        if options:
            sent = errs[0].get("input")
            if errs[0].get("type") == "union_tag_invalid":
                sent = (errs[0].get("ctx") or {}).get("tag", sent)
            shown = repr(sent) if len(repr(sent)) <= 80 else repr(sent)[:77] + "..."
            line = f"{path}: {shown} is not one of {', '.join(dict.fromkeys(options))}"
            guess = closest(sent, options)
            if guess is not None:
                line += f" (did you mean {guess!r}?)"
        else:
            messages = dict.fromkeys(str(e.get("msg", "")) for e in errs)
            line = f"{path}: {'; or '.join(messages)}"
        lines.append(line)
    return "; ".join(lines)


def problem(
    status: int,
    code: str,
    title: str,
    detail: str,
    instance: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": TYPE_BASE + code,
        "title": title,
        "status": status,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _jsonable_errors(errors: Any) -> list[dict[str, Any]]:
    out = []
    for err in errors:
        out.append(
            {
                "loc": [str(p) for p in err.get("loc", ())],
                "msg": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
        )
    return out


def allowed_methods(request: Request) -> str:
    """The ``Allow`` header of a 405: every method the OpenAPI document gives the path (and
    HEAD wherever GET is served, as Starlette answers it).

    Starlette names only the first matching route's methods (``/v1/jobs`` would say ``POST``
    though ``GET`` is served too); RFC 9110 wants all the resource supports, and the document
    (built once by FastAPI, then cached) is the contract clients read them from."""
    methods: set[str] = set()
    for template, operations in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {method.upper() for method in operations}
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers: dict[str, str] | None = None
        if isinstance(exc, QueueFull):  # TenantLimitExceeded too
            headers = {"Retry-After": str(exc.retry_after)}
        elif isinstance(exc, Unauthorized):
            headers = {"WWW-Authenticate": 'Bearer realm="modelprep"'}
        return problem(
            http_status(exc), exc.code, exc.title, exc.message, request.url.path,
            headers=headers,
        )

    from service.exporters import registry

    format_tags = frozenset(registry())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        raw = list(exc.errors())
        errors = _jsonable_errors(raw)
        malformed = any(e["type"] == "json_invalid" for e in errors)
        if malformed:
            return problem(
                400, "malformed_json", "Malformed JSON", "the request body is not valid JSON",
                request.url.path, errors,
            )
        # FastAPI reads a body as JSON only when its content-type says so (strict_content_type,
        # kept on: a browser page can send a body with no content-type without a CORS preflight,
        # so parsing it would let any page submit jobs to a keyless service on localhost).
        content_type = request.headers.get("content-type", "")
        not_json = not content_type or "json" not in content_type.lower()
        if not_json and any(tuple(e["loc"]) == ("body",) for e in errors):
            got = (
                f"got {content_type!r}; curl sends a form unless told "
                "-H 'content-type: application/json'"
                if content_type else "the request had no content-type header"
            )
            return problem(
                415, "unsupported_media_type", "Unsupported media type",
                f"the body must be JSON sent with 'content-type: application/json' ({got})",
                request.url.path, errors,
            )
        summary = readable_errors(raw[:10], format_tags)
        return problem(
            422, "invalid_request", "Invalid request", summary, request.url.path, errors
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        return problem(
            exc.status_code, code, str(exc.detail), str(exc.detail), request.url.path,
            headers=headers or None,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return problem(
            500, "internal_error", "Internal error", "an unexpected error occurred",
            request.url.path,
        )
