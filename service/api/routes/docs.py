"""The API's own documentation, served offline: ``GET /`` (to the operator's page), Swagger UI
at ``/docs`` and the problem-type pages at ``/problems/<code>``.

Swagger UI's files come from the ``swagger-ui-bundle`` package (package data, no CDN), so the
page works air-gapped and behind a strict proxy; they are looked up by name in a fixed table, so
a request path never reaches the filesystem.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from swagger_ui_bundle import swagger_ui_path

from service.api.problems import catalogue, html_index, html_page
from service.errors import NotFound

router = APIRouter(include_in_schema=False)

DOCS_STATIC = "/docs/static/"

_MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
}

SWAGGER_FILES: dict[str, Path] = {
    name: Path(str(swagger_ui_path / name))
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")
}
"""The Swagger UI files ``/docs`` loads, by name: the only paths ``/docs/static/`` answers."""


@router.get("/")
async def root() -> Response:
    """The service's root leads a browser to the operator's page."""
    return RedirectResponse("/ui/", status_code=307)


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    """Swagger UI over ``/openapi.json``, every asset served by this service."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="modelprep API",
        swagger_js_url=DOCS_STATIC + "swagger-ui-bundle.js",
        swagger_css_url=DOCS_STATIC + "swagger-ui.css",
        swagger_favicon_url=DOCS_STATIC + "favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None, "defaultModelsExpandDepth": 0},
    )


@router.get("/docs/static/{name}")
async def swagger_file(name: str) -> Response:
    """One of Swagger UI's files, from the installed package."""
    path = SWAGGER_FILES.get(name)
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
