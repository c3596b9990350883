"""The operator's routes in process: probes, /v1/offload and /metrics, and who may call them."""

from __future__ import annotations

import shutil
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.offload.store import open_job_store
from tests.unit.api.conftest import AppFactory, assert_problem, auth, submit


def test_probes_answer_without_a_key(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ok"
    assert ready.json()["checks"]["database"] == ready.json()["checks"]["data_dir"] == "ok"


def test_readiness_fails_with_the_reason_when_the_data_dir_is_gone(
    app: FastAPI, client: TestClient
) -> None:
    shutil.rmtree(app.state.settings.data_dir)
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["status"] == "unavailable"
    assert ready.json()["checks"]["data_dir"] == "missing"
    assert client.get("/healthz").status_code == 200  # alive, only not ready


def test_offload_figures_are_for_admins_and_name_each_jobs_store(
    app: FastAPI, client: TestClient
) -> None:
    assert_problem(client.get("/v1/offload"), 401, "unauthorized")
    assert_problem(client.get("/v1/offload", headers=auth("a")), 403, "forbidden")
    empty = client.get("/v1/offload", headers=auth("admin"))
    assert empty.status_code == 200 and empty.json()["jobs"] == {}

    store = open_job_store(app.state.settings, "a" * 32, None)
    store.put_tensor("w", torch.zeros(1024))  # 4096 bytes
    store.commit()
    figures = client.get("/v1/offload", headers=auth("admin")).json()
    store.close()
    assert list(figures["jobs"]) == ["a" * 32]
    assert figures["jobs"]["a" * 32]["tensors_written"] == 1
    assert figures["total"]["stores"] == 1 and figures["total"]["bytes_on_disk"] >= 4096
    assert client.get("/v1/offload", headers=auth("admin")).json()["jobs"] == {}


def _samples(text: str, family: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text) if f.name == family for s in f.samples
    }


def test_metrics_are_for_admins_and_count_jobs_and_requests_by_route(
    client: TestClient, llama_job: dict[str, Any]
) -> None:
    assert_problem(client.get("/metrics"), 401, "unauthorized")
    assert_problem(client.get("/metrics", headers=auth("a")), 403, "forbidden")
    for _ in range(2):
        submit(client, llama_job)
    client.get("/v1/jobs/" + "f" * 32, headers=auth("a"))

    response = client.get("/metrics", headers=auth("admin"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    jobs = _samples(response.text, "modelprep_jobs")
    assert jobs[("modelprep_jobs", (("phase", "queued"), ("status", "queued")))] == 2
    assert _samples(response.text, "modelprep_queue_depth") == {("modelprep_queue_depth", ()): 2}
    latency = _samples(response.text, "modelprep_http_request_duration_seconds")
    counts = {dict(labels)["route"]: value for (name, labels), value in latency.items()
              if name.endswith("_count") and dict(labels).get("status") == "404"}
    assert counts == {"/v1/jobs/{job_id}": 1}  # the route's template, never the job id


def test_open_metrics_need_no_key(make_app: AppFactory) -> None:
    client = TestClient(make_app(metrics_open=True))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "modelprep_data_dir_free_bytes" in response.text
