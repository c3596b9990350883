"""The served API conforms to its own OpenAPI document: schemathesis, every check, against a
real server process on loopback, read through its live ``/openapi.json`` with a tenant key.

Bounded and deterministic (``--generation-deterministic``, a per-operation example cap), so a
run costs about a minute and the same cases run every time; any finding fails the test with
schemathesis' report (the case and a curl line to reproduce it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from service.api.auth import key_digest
from tests.fixtures.service import running_service

CONFIG = Path(__file__).with_name("schemathesis.toml")
KEY = "conformance-tenant-key"
MAX_EXAMPLES = 10


def test_the_api_conforms_to_its_openapi_document(tmp_path: Path) -> None:
    keys = f'[{{"tenant": "acme", "sha256": "{key_digest(KEY)}"}}]'
    env = {"MODELPREP_API_KEYS": keys, "MODELPREP_WORKERS": "1"}
    st = Path(sys.executable).with_name("st")
    with running_service(tmp_path / "data", env=env) as service:
        # schemathesis skips an empty Allow header: check what a 405 names here
        with service.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
            for method, path, allow in [("OPTIONS", "/v1/jobs", "GET, HEAD, POST"),
                                        ("PUT", "/v1/jobs/0", "DELETE, GET, HEAD"),
                                        ("POST", "/metrics", "GET, HEAD")]:
                response = client.request(method, path)
                assert response.status_code == 405, (method, path, response.text)
                assert response.headers["allow"] == allow, (method, path)
                assert response.headers["content-type"] == "application/problem+json"
        run = subprocess.run(
            [str(st), "--config-file", str(CONFIG), "run", f"{service.url}/openapi.json",
             "--checks", "all", "--header", f"Authorization: Bearer {KEY}",
             "--generation-deterministic", "--max-examples", str(MAX_EXAMPLES),
             "--workers", "1", "--request-timeout", "30", "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False,
        )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-12000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated.group(1)) >= 200, report[-4000:]
