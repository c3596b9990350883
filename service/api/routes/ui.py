"""The operator's page at ``/ui``: static files shipped in the package, no data of its own.

The page is a client of the same ``/v1`` API as curl: it holds the caller's key in
``sessionStorage`` and sends it as ``Authorization: Bearer``, so it can see exactly what the key
can see and nothing more. These routes therefore need no key: they serve only the files below,
looked up by name in a fixed table (a request path never reaches the filesystem), with a
Content-Security-Policy that allows scripts, styles and connections to this origin only, because
the service runs air-gapped and a page holding an API key must not load anything from elsewhere.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse, Response

from service.errors import NotFound

router = APIRouter(tags=["ui"], include_in_schema=False)

_STATIC = Path(str(resources.files("service.api") / "ui"))

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

FILES: dict[str, Path] = {
    p.name: p for p in sorted(_STATIC.iterdir()) if p.suffix in _MEDIA_TYPES
}
"""Every file the page is made of, by name: the only paths these routes answer."""

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The files change with the package: revalidate rather than run a stale page.
    "Cache-Control": "no-cache",
}


def _serve(name: str) -> Response:
    path = FILES.get(name)
    if path is None:
        raise NotFound(f"no UI file named {name!r}")
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS)


@router.get("/ui")
async def ui_root() -> Response:
    """Redirect to ``/ui/`` so the page's relative module imports resolve under it."""
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/")
async def ui_index() -> Response:
    """The page itself; routing within it happens in the URL fragment."""
    return _serve("index.html")


@router.get("/ui/{name}")
async def ui_file(name: str) -> Response:
    """One of the page's modules or its stylesheet."""
    return _serve(name)
