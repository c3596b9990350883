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


def test_every_cursor_the_schema_allows_is_one_the_route_reads() -> None:
    """The list route's cursor is ``<microseconds>.<id>``: a page's next_cursor reads back to
    the same position, and the largest value the pattern allows is still a valid date."""
    import re
    from datetime import UTC, datetime

    from service.api.routes.jobs import CURSOR_PATTERN, _decode_cursor, _encode_cursor

    created = datetime(2026, 11, 23, 12, 0, 1, 123456, tzinfo=UTC)
    cursor = _encode_cursor(created, "ab" * 16)
    assert re.match(CURSOR_PATTERN, cursor) and _decode_cursor(cursor) == (created, "ab" * 16)
    assert _decode_cursor("9" * 17 + "." + "z" * 36)[0].year < 9999
    parameters = openapi_document()["paths"]["/v1/jobs"]["get"]["parameters"]
    (cursor_schema,) = [p["schema"] for p in parameters if p["name"] == "cursor"]
    assert cursor_schema["anyOf"][0]["pattern"] == CURSOR_PATTERN
