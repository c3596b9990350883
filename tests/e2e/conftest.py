"""Loopback servers the end-to-end tests point the service at."""

from __future__ import annotations

from tests.fixtures.http_server import http_server
from tests.fixtures.hub import local_hub

__all__ = ["http_server", "local_hub"]
