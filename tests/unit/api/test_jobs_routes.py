"""/v1/jobs in process: submit, validation as problem+json, get, list with its cursor, delete,
events, and who may see what."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.unit.api.conftest import (
    AppFactory,
    assert_problem,
    auth,
    submit,
    succeed,
)


def test_a_valid_submit_is_queued_and_readable_at_its_location(
    client: TestClient, llama_job: dict[str, Any]
) -> None:
    response = client.post("/v1/jobs", json=llama_job, headers=auth("a"))
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert (job["status"], job["phase"], job["tenant"]) == ("queued", "queued", "a")
    assert job["request"]["source"] == llama_job["source"]
    assert job["artifacts"] == [] and job["error"] is None and job["attempts"] == 0

    again = client.get(response.headers["location"], headers=auth("a"))
    assert again.status_code == 200
    assert again.headers["content-type"] == "application/json"
    assert {k: again.json()[k] for k in ("id", "status", "created_at")} == {
        k: job[k] for k in ("id", "status", "created_at")
    }


@pytest.mark.parametrize(
    ("body", "code", "located"),
    [
        ({"source": "ftp://x/y", "exports": [{"format": "safetensors"}]}, "invalid_request",
         False),
        ({"source": "file:///x", "exports": [{"format": "tflite"}]}, "invalid_request", True),
        ({"source": "file:///x", "exports": [{"format": "safetensors", "dtype": "float8"}]},
         "invalid_request", True),
        ({"source": "file:///x", "exports": []}, "invalid_request", True),
        ({"exports": [{"format": "safetensors"}]}, "invalid_request", True),
        ({"source": "file:///etc", "exports": [{"format": "safetensors"}]}, "source_not_allowed",
         False),
    ],
)
def test_bad_submits_are_422_problems(
    client: TestClient, body: dict[str, Any], code: str, located: bool
) -> None:
    """``located``: the schema refused it, so each complaint says where in the body."""
    problem = assert_problem(client.post("/v1/jobs", json=body, headers=auth("a")), 422, code)
    assert problem["instance"] == "/v1/jobs"
    assert ("errors" in problem) == located
    if located:
        assert problem["errors"] and all(e["loc"][0] == "body" for e in problem["errors"])


def test_a_source_missing_under_the_root_is_a_422_and_queues_nothing(
    client: TestClient, llama_safetensors_dir: Path
) -> None:
    body = {"source": (llama_safetensors_dir.parent / "nope").as_uri(),
            "exports": [{"format": "safetensors"}]}
    assert_problem(client.post("/v1/jobs", json=body, headers=auth("a")), 422, "source_not_found")
    assert client.get("/v1/jobs", headers=auth("admin")).json()["items"] == []


def test_malformed_json_is_a_400_problem(client: TestClient) -> None:
    response = client.post(
        "/v1/jobs", content=b'{"source": ', headers={**auth("a"), "content-type": "application/json"}
    )
    assert_problem(response, 400, "malformed_json")


def test_a_full_queue_answers_429_with_retry_after(
    make_app: AppFactory, llama_job: dict[str, Any]
) -> None:
    client = TestClient(make_app(max_queued=1))
    submit(client, llama_job)
    response = client.post("/v1/jobs", json=llama_job, headers=auth("b"))
    assert_problem(response, 429, "queue_full")
    assert int(response.headers["retry-after"]) > 0


def test_the_hf_token_is_neither_echoed_nor_stored(
    app: FastAPI, client: TestClient, llama_job: dict[str, Any]
) -> None:
    token = "hf_secretTOKEN1234567890"
    job = submit(client, {**llama_job, "hf_token": token})
    assert token not in client.get(f"/v1/jobs/{job['id']}", headers=auth("a")).text
    assert token not in str(job)
    db = sqlite3.connect(app.state.settings.data_dir / "modelprep.db")
    try:
        assert token not in "\n".join(db.iterdump())
    finally:
        db.close()


def test_unknown_jobs_routes_and_methods_are_problems(client: TestClient) -> None:
    assert_problem(client.get("/v1/jobs/" + "0" * 32, headers=auth("a")), 404, "job_not_found")
    assert_problem(client.get("/v1/nothing-here", headers=auth("a")), 404, "not_found")
    response = client.put("/v1/jobs", headers=auth("a"))
    assert_problem(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "GET, HEAD, POST"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/x"), ("DELETE", "/v1/jobs/x"),
     ("GET", "/v1/jobs/x/artifacts/model.safetensors"), ("GET", "/v1/jobs/x/events"),
     ("GET", "/v1/offload")],
)
def test_every_v1_route_answers_401_without_a_valid_key(
    client: TestClient, method: str, path: str
) -> None:
    for headers in ({}, {"Authorization": "Bearer mp_not-a-key"}):
        response = client.request(method, path, headers=headers)
        assert_problem(response, 401, "unauthorized")
        assert response.headers["www-authenticate"] == 'Bearer realm="modelprep"'


def test_another_tenants_job_is_indistinguishable_from_a_missing_one(
    client: TestClient, llama_job: dict[str, Any]
) -> None:
    job = submit(client, llama_job, who="a")
    theirs = client.get(f"/v1/jobs/{job['id']}", headers=auth("b"))
    missing = client.get("/v1/jobs/" + "f" * 32, headers=auth("b"))
    assert_problem(theirs, 404, "job_not_found")
    assert theirs.json()["title"] == missing.json()["title"]
    assert_problem(client.delete(f"/v1/jobs/{job['id']}", headers=auth("b")), 404,
                   "job_not_found")
    assert client.get("/v1/jobs", headers=auth("b")).json()["items"] == []
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth("admin")).json()["tenant"] == "a"
    assert [j["id"] for j in client.get("/v1/jobs", headers=auth("admin")).json()["items"]] == [
        job["id"]
    ]


def test_pages_walk_every_job_once_newest_first_and_filter_by_status(
    app: FastAPI, client: TestClient, llama_job: dict[str, Any]
) -> None:
    ids = [submit(client, llama_job)["id"] for _ in range(5)]
    for job_id in ids[:2]:
        succeed(app, job_id, {"model.safetensors": b"x"})

    seen: list[dict[str, Any]] = []
    pages = 0
    params: dict[str, Any] = {"limit": 2}
    while True:
        page = client.get("/v1/jobs", params=params, headers=auth("a")).json()
        pages += 1
        seen += page["items"]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert pages == 3 and len(seen) == 5
    assert sorted(j["id"] for j in seen) == sorted(ids)
    created = [j["created_at"] for j in seen]
    assert created == sorted(created, reverse=True)

    done = client.get("/v1/jobs", params={"status": "succeeded"}, headers=auth("a")).json()
    assert sorted(j["id"] for j in done["items"]) == sorted(ids[:2])
    assert done["next_cursor"] is None
    queued = client.get("/v1/jobs", params={"status": "queued", "limit": 3}, headers=auth("a"))
    assert [j["status"] for j in queued.json()["items"]] == ["queued"] * 3
    assert queued.json()["next_cursor"] is not None  # a full page: there may be more


@pytest.mark.parametrize(
    "params",
    [{"status": "bogus"}, {"cursor": "not-a-cursor"}, {"cursor": "1.x/y"}, {"limit": 0},
     {"limit": 501}],
)
def test_bad_list_parameters_are_422_problems(client: TestClient, params: dict[str, Any]) -> None:
    assert_problem(client.get("/v1/jobs", params=params, headers=auth("a")), 422,
                   "invalid_request")


def test_deleting_a_queued_job_cancels_it(client: TestClient, llama_job: dict[str, Any]) -> None:
    job = submit(client, llama_job)
    response = client.delete(f"/v1/jobs/{job['id']}", headers=auth("a"))
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth("a")).json()["status"] == "cancelled"


def test_deleting_a_finished_job_removes_its_files_and_keeps_the_job(
    app: FastAPI, client: TestClient, llama_job: dict[str, Any]
) -> None:
    job = submit(client, llama_job)
    succeed(app, job["id"], {"model.safetensors": b"weights"})
    artifacts = app.state.settings.jobs_dir / job["id"] / "artifacts"
    assert (artifacts / "model.safetensors").is_file()

    response = client.delete(f"/v1/jobs/{job['id']}", headers=auth("a"))
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded"
    assert not artifacts.exists()
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth("a")).json()["status"] == "succeeded"


@pytest.mark.timeout(60)
def test_events_of_a_finished_job_are_its_final_state_then_the_end(
    app: FastAPI, client: TestClient, llama_job: dict[str, Any]
) -> None:
    job = submit(client, llama_job)
    succeed(app, job["id"], {"model.safetensors": b"x"})
    with client.stream("GET", f"/v1/jobs/{job['id']}/events", headers=auth("a")) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]
    fields = dict(line.split(": ", 1) for line in lines)
    assert fields["event"] == "status"
    assert json.loads(fields["data"])["status"] == "succeeded"
    version = fields["id"]
    resumed = client.get(f"/v1/jobs/{job['id']}/events",
                         headers={**auth("a"), "Last-Event-ID": version})
    assert resumed.status_code == 200 and "data:" not in resumed.text  # nothing newer
    assert_problem(client.get(f"/v1/jobs/{job['id']}/events", headers=auth("b")), 404,
                   "job_not_found")
