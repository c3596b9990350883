"""/v1/jobs/{id}/artifacts in process: the bytes with ETag and Range, refusals, 404 and 410."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.unit.api.conftest import assert_problem, auth, submit, succeed

WEIGHTS = bytes(range(256)) * 4


@pytest.fixture
def done(app: FastAPI, client: TestClient, llama_job: dict[str, Any]) -> dict[str, Any]:
    """A succeeded job of tenant ``a`` with two artifacts, as GET shows it."""
    job = submit(client, llama_job)
    succeed(app, job["id"], {"model.safetensors": WEIGHTS, "manifest.json": b"{}"})
    finished: dict[str, Any] = client.get(f"/v1/jobs/{job['id']}", headers=auth("a")).json()
    return finished


def test_an_artifact_downloads_whole_with_its_digest_as_etag(
    client: TestClient, done: dict[str, Any]
) -> None:
    artifact = next(a for a in done["artifacts"] if a["path"] == "model.safetensors")
    assert artifact == {"path": "model.safetensors", "size": len(WEIGHTS),
                        "sha256": hashlib.sha256(WEIGHTS).hexdigest(),
                        "url": f"/v1/jobs/{done['id']}/artifacts/model.safetensors"}
    response = client.get(artifact["url"], headers=auth("a"))
    assert response.status_code == 200
    assert response.content == WEIGHTS
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["etag"] == f'"{artifact["sha256"]}"'


def test_a_range_is_206_and_a_matching_etag_is_304(
    client: TestClient, done: dict[str, Any]
) -> None:
    url = f"/v1/jobs/{done['id']}/artifacts/model.safetensors"
    part = client.get(url, headers={**auth("a"), "Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == WEIGHTS[10:20]
    etag = client.get(url, headers=auth("a")).headers["etag"]
    again = client.get(url, headers={**auth("a"), "If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [("../../../modelprep.db", 404, "not_found"),  # dots resolved by the client: no route
     ("..%2F..%2Fmodelprep.db", 403, "path_outside_root"),
     ("%2Fetc%2Fpasswd", 403, "path_outside_root"),
     ("nope.bin", 404, "artifact_not_found")],
)
def test_paths_outside_the_jobs_artifacts_are_refused(
    client: TestClient, done: dict[str, Any], path: str, status: int, code: str
) -> None:
    response = client.get(f"/v1/jobs/{done['id']}/artifacts/{path}", headers=auth("a"))
    assert_problem(response, status, code)
    assert b"SQLite" not in response.content


def test_a_job_that_has_not_succeeded_has_no_artifacts(
    client: TestClient, llama_job: dict[str, Any]
) -> None:
    job = submit(client, llama_job)
    response = client.get(f"/v1/jobs/{job['id']}/artifacts/model.safetensors", headers=auth("a"))
    assert_problem(response, 404, "artifact_not_found")


def test_another_tenants_artifact_is_a_missing_job(
    client: TestClient, done: dict[str, Any]
) -> None:
    response = client.get(f"/v1/jobs/{done['id']}/artifacts/model.safetensors", headers=auth("b"))
    assert_problem(response, 404, "job_not_found")


def test_artifacts_of_a_deleted_job_are_gone_not_missing(
    client: TestClient, done: dict[str, Any]
) -> None:
    assert client.delete(f"/v1/jobs/{done['id']}", headers=auth("a")).status_code == 200
    for artifact in done["artifacts"]:
        assert_problem(client.get(artifact["url"], headers=auth("a")), 410, "artifact_gone")
