"""``modelprep healthcheck``: the one container probe for both roles (worker heartbeat file,
else the API's /readyz), run as the real command against a real HTTP server on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.http_server import FileServer, Route, http_server

__all__ = ["http_server"]


def healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "healthcheck", *args],
        check=False, capture_output=True, text=True, timeout=60,
    )


def test_fresh_worker_heartbeat_file_is_healthy(tmp_path: Path) -> None:
    alive = tmp_path / "alive"
    alive.touch()
    assert healthcheck("--file", str(alive), "--max-age", "30").returncode == 0


def test_stale_worker_heartbeat_file_is_unhealthy(tmp_path: Path) -> None:
    alive = tmp_path / "alive"
    alive.touch()
    old = time.time() - 120
    os.utime(alive, (old, old))
    result = healthcheck("--file", str(alive), "--max-age", "30")
    assert result.returncode == 1 and "old" in result.stderr


def test_without_heartbeat_file_the_api_readiness_decides(
    tmp_path: Path, http_server: FileServer
) -> None:
    missing = str(tmp_path / "none")
    ready = http_server.add("/readyz", Route(body=b'{"status":"ok"}'))
    assert healthcheck("--file", missing, "--url", ready).returncode == 0
    unready = http_server.add("/unready", Route(body=b"{}", status=503))
    assert healthcheck("--file", missing, "--url", unready).returncode == 1


def test_no_api_listening_is_unhealthy(tmp_path: Path) -> None:
    result = healthcheck("--file", str(tmp_path / "none"), "--url", "http://127.0.0.1:9/readyz")
    assert result.returncode == 1
