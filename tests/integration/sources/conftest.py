"""Real servers on loopback for source tests: olah as a hub, a small HTTP file server."""

from __future__ import annotations

from tests.fixtures.http_server import http_server
from tests.fixtures.hub import local_hub

__all__ = ["http_server", "local_hub"]
