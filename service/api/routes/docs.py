"""The API's own documentation, served offline: ``GET /`` (to the operator's page), Swagger UI
at ``/docs``, Redoc at ``/redoc`` and the problem-type pages at ``/problems/<code>``.

Swagger UI's and Redoc's files come from the ``fastapi-offline`` package (package data, no CDN),
so the pages work air-gapped and behind a strict proxy; they are looked up by name in a fixed
table, so a request path never reaches the filesystem.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from service.api.problems import catalogue, html_index, html_page
from service.errors import NotFound

router = APIRouter(include_in_schema=False)

DOCS_POLICY = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' "
        "'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
        "worker-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
"""What ``/docs`` and ``/redoc`` may load: this origin only (their inline start-up script and
styles included), so neither page reaches another host, Redoc's "powered by" logo included."""

DOCS_STATIC = "/docs/static/"

_MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
}

_STATIC = Path(str(resources.files("fastapi_offline") / "static"))

DOC_FILES: dict[str, Path] = {
    name: _STATIC / name
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
}
"""The files ``/docs`` and ``/redoc`` load, by name: the only paths ``/docs/static/`` answers."""


@router.get("/")
async def root() -> Response:
    """The service's root leads a browser to the operator's page."""
    return RedirectResponse("/ui/", status_code=307)


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    """Swagger UI over ``/openapi.json``, every asset served by this service."""
    page = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="modelprep API",
        swagger_js_url=DOCS_STATIC + "swagger-ui-bundle.js",
        swagger_css_url=DOCS_STATIC + "swagger-ui.css",
        swagger_favicon_url=DOCS_STATIC + "favicon.png",
        swagger_ui_parameters={"validatorUrl": None, "defaultModelsExpandDepth": 0},
    )
    page.headers.update(DOCS_POLICY)
    return page


@router.get("/redoc")
async def redoc() -> HTMLResponse:
    """Redoc over ``/openapi.json``, its script served by this service (no web fonts)."""
    page = get_redoc_html(
        openapi_url="/openapi.json",
        title="modelprep API",
        redoc_js_url=DOCS_STATIC + "redoc.standalone.js",
        redoc_favicon_url=DOCS_STATIC + "favicon.png",
        with_google_fonts=False,
    )
    page.headers.update(DOCS_POLICY)
    return page


@router.get("/docs/static/{name}")
async def swagger_file(name: str) -> Response:
    """One of Swagger UI's or Redoc's files, from the installed package."""
    path = DOC_FILES.get(name)
    if path is None:
        raise NotFound(f"no documentation file named {name!r}")
    return FileResponse(
        path, media_type=_MEDIA_TYPES[path.suffix], headers={"Cache-Control": "max-age=86400"}
    )


@router.get("/problems")
async def problem_index() -> HTMLResponse:
    """Every problem type, each linking to its page."""
    return HTMLResponse(html_index())


@router.get("/problems/{code}")
async def problem_page(code: str) -> HTMLResponse:
    """What a problem ``type`` means and how to fix it: the page its URI names."""
    problem = catalogue().get(code)
    if problem is None:
        raise NotFound(f"no problem type {code!r}; GET /problems lists them")
    return HTMLResponse(html_page(problem))
