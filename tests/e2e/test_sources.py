"""Sources through the API: a real hub (olah on loopback) and a real HTTP server."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.models import build_checkpoint, build_tiny_model, save_checkpoint
from tests.fixtures.service import ServiceProcess, running_service


@pytest.fixture(scope="module")
def service(local_hub: LocalHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    env = {
        "MODELPREP_HF_ENDPOINT": local_hub.endpoint,
        "MODELPREP_DOWNLOAD_BACKOFF_SECONDS": "0.05",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with running_service(tmp_path_factory.mktemp("data"), env=env) as svc:
        yield svc


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "v1": build_checkpoint(root / "v1", "llama", "safetensors", seed=0),
        "v2": build_checkpoint(root / "v2", "llama", "safetensors", seed=1),
        "bin": save_checkpoint(build_tiny_model("llama", seed=0), root / "bin", "bin"),
    }


def repo_id() -> str:
    return f"org/tiny-{uuid.uuid4().hex[:8]}"


def run(svc: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    with svc.client() as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return svc.wait_for(response.json()["id"], timeout=180)


def manifest(svc: ServiceProcess, job: dict[str, Any]) -> dict[str, Any]:
    with svc.client() as client:
        data: dict[str, Any] = client.get(f"/v1/jobs/{job['id']}/artifacts/manifest.json").json()
        return data


def test_branch_and_tag_are_prepared_and_recorded_by_commit(
    service: ServiceProcess, local_hub: LocalHub, checkpoints: dict[str, Path]
) -> None:
    repo = repo_id()
    main_sha = local_hub.create_repo(repo, files_of(checkpoints["v1"]))
    tag_sha = local_hub.create_repo(repo, files_of(checkpoints["v2"]), branch="dev", tag="v2.0")
    exports = [{"format": "safetensors", "dtype": "bfloat16"}]
    on_main = run(service, {"source": f"hf://{repo}", "exports": exports})
    on_tag = run(service, {"source": f"hf://{repo}", "revision": "v2.0", "exports": exports})
    for job, sha in ((on_main, main_sha), (on_tag, tag_sha)):
        assert job["status"] == "succeeded", job["error"]
        assert job["source"]["revision"] == sha
        assert manifest(service, job)["source"]["revision"] == sha
    digest = {
        j["id"]: next(a["sha256"] for a in j["artifacts"] if a["path"].endswith(".safetensors"))
        for j in (on_main, on_tag)
    }
    assert digest[on_main["id"]] != digest[on_tag["id"]]


def test_only_safetensors_are_downloaded_when_a_repo_has_both(
    service: ServiceProcess, local_hub: LocalHub, checkpoints: dict[str, Path]
) -> None:
    repo = repo_id()
    local_hub.create_repo(repo, {**files_of(checkpoints["bin"]), **files_of(checkpoints["v1"])})
    job = run(service, {"source": f"hf://{repo}", "exports": [{"format": "safetensors"}]})
    assert job["status"] == "succeeded", job["error"]
    assert manifest(service, job)["model"]["format"] == "safetensors"
    assert local_hub.served("GET", repo, "model.safetensors") >= 1
    assert local_hub.served("GET", repo, "pytorch_model.bin") == 0


def test_two_concurrent_jobs_of_one_repo_download_it_once(
    service: ServiceProcess, local_hub: LocalHub, checkpoints: dict[str, Path]
) -> None:
    repo = repo_id()
    local_hub.create_repo(repo, files_of(checkpoints["v1"]))
    # reuse off: both jobs download (through the cache) rather than one sharing the other's
    body = {"source": f"hf://{repo}", "exports": [{"format": "safetensors"}], "reuse": False}
    with service.client() as client:
        ids = [client.post("/v1/jobs", json=body).json()["id"] for _ in range(2)]
    jobs = [service.wait_for(i, timeout=180) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs), [j["error"] for j in jobs]
    # one download (each submission also reads the header: a bounded range, not a download)
    assert len(local_hub.downloads(repo, "resolve", "model.safetensors")) == 1
    assert sorted(bool(j["metrics"].get("cache_hit")) for j in jobs) == [False, True]


def test_a_cut_http_download_is_resumed_and_checked(
    service: ServiceProcess, http_server: FileServer, checkpoints: dict[str, Path]
) -> None:
    weights = (checkpoints["v1"] / "model.safetensors").read_bytes()
    # every response is cut after a third of the file (the submission's header read's too,
    # which needs less): the download only completes by resuming where each cut left it
    url = http_server.add("/cut/model.safetensors",
                          Route(body=weights, cut_after=len(weights) // 3, cuts=100))
    job = run(service, {"source": url, "sha256": hashlib.sha256(weights).hexdigest(),
                        "exports": [{"format": "safetensors"}]})
    assert job["status"] == "succeeded", job["error"]
    ranges = [s.range for s in http_server.downloads("/cut/model.safetensors")]
    assert ranges[0] is None and len(ranges) >= 3, ranges
    assert all(r and r.startswith("bytes=") for r in ranges[1:]), ranges
    assert job["metrics"]["bytes_downloaded"] >= len(weights)


@pytest.mark.parametrize(
    ("route", "sha256", "error_type"),
    [
        (Route(body=b"not the weights"), "0" * 64, "checksum_mismatch"),
        (Route(body=b"gone", status=404), None, "source_not_found"),
        (Route(body=b"who are you", status=401), None, "source_unauthorized"),
    ],
    ids=["wrong-sha256", "404", "401"],
)
def test_http_failures_fail_the_job_with_their_type(
    service: ServiceProcess, http_server: FileServer, route: Route, sha256: str | None,
    error_type: str,
) -> None:
    url = http_server.add(f"/{uuid.uuid4().hex}/model.safetensors", route)
    body: dict[str, Any] = {"source": url, "exports": [{"format": "safetensors"}]}
    if sha256:
        body["sha256"] = sha256
    job = run(service, body)
    assert job["status"] == "failed"
    assert job["error"]["type"] == error_type, job["error"]
    assert job["artifacts"] == []


def test_a_hub_token_never_reaches_logs_json_or_database(
    service: ServiceProcess, local_hub: LocalHub, checkpoints: dict[str, Path]
) -> None:
    token = f"hf_{uuid.uuid4().hex}"
    repo = repo_id()
    local_hub.create_repo(repo, files_of(checkpoints["v1"]))
    job = run(service, {"source": f"hf://{repo}", "hf_token": token,
                        "exports": [{"format": "safetensors"}]})
    assert job["status"] == "succeeded", job["error"]
    assert token not in json.dumps(job)
    assert token not in json.dumps(manifest(service, job))
    assert token not in service.logs()
    dump = "\n".join(sqlite3.connect(service.data_dir / "modelprep.db").iterdump())
    assert token not in dump


def test_a_metadata_service_url_is_refused_at_submission(service: ServiceProcess) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": "http://169.254.169.254/latest/meta-data/model.safetensors",
            "exports": [{"format": "safetensors"}]})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["type"].endswith("egress_refused")


def test_a_redirect_to_a_private_address_fails_the_job_as_egress_refused(
    service: ServiceProcess, http_server: FileServer
) -> None:
    url = http_server.add(f"/{uuid.uuid4().hex}/model.safetensors", Route(
        status=302, headers={"Location": "http://10.255.255.1/model.safetensors"}))
    job = run(service, {"source": url, "exports": [{"format": "safetensors"}]})
    assert job["status"] == "failed"
    assert job["error"]["type"] == "egress_refused", job["error"]
    assert job["artifacts"] == []


def test_a_job_past_its_timeout_is_killed_and_fails_job_timeout(
    service: ServiceProcess, http_server: FileServer, checkpoints: dict[str, Path]
) -> None:
    weights = checkpoints["v1"] / "model.safetensors"
    url = http_server.add(f"/{uuid.uuid4().hex}/model.safetensors",
                          Route(body=weights, bytes_per_second=20_000))  # ~20 s
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": url, "exports": [{"format": "safetensors"}], "timeout": 1.5})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    service.wait_for(job_id, timeout=120, until={"running", "failed", "succeeded"})
    job = service.wait_for(job_id, timeout=15)  # the limit counts from the start, not the queue
    assert job["status"] == "failed" and job["error"]["type"] == "job_timeout", job
    assert job["artifacts"] == []
    elapsed = (datetime.fromisoformat(job["finished_at"])
               - datetime.fromisoformat(job["started_at"])).total_seconds()
    assert 1.5 <= elapsed < 6
    assert not (service.data_dir / "jobs" / job["id"] / "artifacts").exists()


def test_a_timeout_that_is_not_a_positive_number_is_refused(service: ServiceProcess) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": "http://127.0.0.1:9/model.safetensors",
            "exports": [{"format": "safetensors"}], "timeout": 0})
    assert response.status_code == 422, response.text


def test_deleting_a_finished_job_removes_its_files_and_its_artifact_urls_answer_410(
    service: ServiceProcess, http_server: FileServer, checkpoints: dict[str, Path]
) -> None:
    weights = (checkpoints["v1"] / "model.safetensors").read_bytes()
    url = http_server.add(f"/{uuid.uuid4().hex}/model.safetensors", Route(body=weights))
    # reuse off: its own files, not links shared with an earlier job of the same bytes
    job = run(service, {"source": url, "exports": [{"format": "safetensors"}], "reuse": False})
    assert job["status"] == "succeeded", job["error"]
    artifact_url = job["artifacts"][0]["url"]
    with service.client() as client:
        assert client.get(artifact_url).status_code == 200
        deleted = client.delete(f"/v1/jobs/{job['id']}")
        assert deleted.status_code == 200, deleted.text
        body = deleted.json()
        assert body["status"] == "succeeded" and body["artifacts"] == [] and body["deleted_at"]
        assert body["metrics"]["artifact_bytes_freed"] >= sum(
            a["size"] for a in job["artifacts"])
        gone = client.get(artifact_url)
        assert gone.status_code == 410
        assert gone.headers["content-type"].startswith("application/problem+json")
        assert client.get(f"/v1/jobs/{job['id']}").json()["deleted_at"] == body["deleted_at"]
        scrape = client.get("/metrics")
    assert not (service.data_dir / "jobs" / job["id"]).exists()
    if scrape.status_code == 200:  # open mode on loopback
        freed = [line for line in scrape.text.splitlines()
                 if line.startswith("modelprep_job_artifact_bytes_freed_total")]
        assert freed and float(freed[0].split()[-1]) >= body["metrics"]["artifact_bytes_freed"]
