"""The OpenAPI document, generated from the app and checked in under openapi/."""

from __future__ import annotations

from typing import Any

from service.api.app import create_app
from service.config import Settings


def openapi_document() -> dict[str, Any]:
    """The document of an app built with default settings (the contract does not depend on them)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(data_dir=Path(tmp)))
        return app.openapi()
