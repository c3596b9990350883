"""The checked-in OpenAPI document is the contract; it must match what the app serves."""

from __future__ import annotations

import json
from pathlib import Path

from service.api.openapi import openapi_document

DOCUMENT = Path(__file__).parents[3] / "openapi" / "openapi.json"


def test_checked_in_openapi_matches_the_app() -> None:
    checked_in = json.loads(DOCUMENT.read_text())
    assert checked_in == json.loads(json.dumps(openapi_document())), (
        "openapi/openapi.json is stale: run `make openapi` and commit it"
    )


def test_contract_keeps_the_v1_names() -> None:
    paths = openapi_document()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/artifacts/{path}", "/healthz",
            "/readyz"} <= set(paths)
    assert {"post", "get"} <= set(paths["/v1/jobs"]) and "delete" in paths["/v1/jobs/{job_id}"]
