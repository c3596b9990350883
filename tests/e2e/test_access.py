"""Access control, tenant limits, metrics, live events and logs, on a real server process with
API keys configured (tenants a and b, one admin)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.api.auth import key_digest
from service.client import JobEvent, ModelprepClient
from tests.fixtures.models import build_checkpoint
from tests.fixtures.service import ServiceProcess, free_port, running_service

PROBLEM = "application/problem+json"
KEYS = {"a": "mp_tenant-a-key-0123456789abcdef", "b": "mp_tenant-b-key-0123456789abcdef",
        "admin": "mp_admin-key-0123456789abcdef01"}
HF_TOKEN = "hf_neverLoggedToken0123456789"


def keys_setting() -> str:
    return json.dumps([
        {"tenant": "a", "sha256": key_digest(KEYS["a"])},
        {"tenant": "b", "sha256": key_digest(KEYS["b"])},
        {"tenant": "ops", "sha256": key_digest(KEYS["admin"]), "admin": True},
    ])


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    return root


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    env = {"MODELPREP_API_KEYS": keys_setting(), "MODELPREP_TENANT_MAX_ACTIVE": "1"}
    with running_service(tmp_path_factory.mktemp("data"), [root], env=env) as svc:
        yield svc


def llama(root: Path, **extra: Any) -> dict[str, Any]:
    return {"source": f"file://{root / 'llama'}", "exports": [{"format": "safetensors"}], **extra}


@dataclass
class StreamedJob:
    job: dict[str, Any]
    events: list[JobEvent]


@pytest.fixture(scope="module")
def streamed(service: ServiceProcess, root: Path) -> StreamedJob:
    """A job of tenant a, followed live through its events stream from submission to the end."""
    with ModelprepClient(service.url, KEYS["a"]) as client:
        job = client.submit(llama(root, hf_token=HF_TOKEN))
        events = list(client.events(job["id"]))
        return StreamedJob(client.job(job["id"]), events)


def test_the_events_stream_follows_a_job_to_its_final_status(streamed: StreamedJob) -> None:
    events = streamed.events
    versions = [e.version for e in events]
    assert versions == sorted(set(versions)), "event ids are the growing job version"
    assert events[0].kind == "status"
    assert events[-1].kind == "status" and events[-1].data["status"] == "succeeded"
    assert all(not e.terminal for e in events[:-1])
    assert {e.data["status"] for e in events[:-1]} <= {"queued", "running"}
    assert events[-1].data["metrics"]["bytes_written"] > 0


def test_events_resume_after_last_event_id(service: ServiceProcess, streamed: StreamedJob) -> None:
    final = streamed.events[-1].version
    with ModelprepClient(service.url, KEYS["a"]) as client:
        resumed = list(client.events(streamed.job["id"], last_event_id=final - 1))
        assert [(e.version, e.data["status"]) for e in resumed] == [(final, "succeeded")]
        assert list(client.events(streamed.job["id"], last_event_id=final)) == []
        assert [e.version for e in client.follow(streamed.job["id"], last_event_id=final)] == []


def test_job_records_its_tenant_and_phase_timeline(streamed: StreamedJob) -> None:
    phases = streamed.job["phases"]
    assert [p["phase"] for p in phases][:2] == ["download", "read"]
    assert all(p["seconds"] is not None and p["seconds"] >= 0 for p in phases)


def _all_job_urls(job_id: str) -> list[tuple[str, str]]:
    return [
        ("GET", f"/v1/jobs/{job_id}"),
        ("DELETE", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/artifacts/manifest.json"),
        ("GET", f"/v1/jobs/{job_id}/events"),
    ]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer mp_not-a-configured-key"},
        {"Authorization": "Basic YTpi"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {KEYS['a']}x"},
    ],
    ids=["no-key", "wrong-key", "basic-scheme", "empty-bearer", "key-with-suffix"],
)
def test_every_job_route_answers_401_without_a_valid_key(
    service: ServiceProcess, streamed: StreamedJob, root: Path, headers: dict[str, str]
) -> None:
    with service.client(headers=headers) as client:
        calls = [*_all_job_urls(streamed.job["id"]), ("GET", "/v1/jobs")]
        for method, url in calls:
            response = client.request(method, url)
            assert response.status_code == 401, (method, url, response.text)
            assert response.headers["content-type"] == PROBLEM
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert response.json()["type"].endswith("unauthorized")
        submitted = client.post("/v1/jobs", json=llama(root))
        assert submitted.status_code == 401


def test_another_tenants_job_is_indistinguishable_from_a_missing_one(
    service: ServiceProcess, streamed: StreamedJob
) -> None:
    job_id = streamed.job["id"]
    with service.client(headers=auth("b")) as client:
        for method, url in _all_job_urls(job_id):
            response = client.request(method, url)
            missing = client.request(method, url.replace(job_id, "f" * 32))
            assert response.status_code == 404, (method, url, response.text)
            assert response.headers["content-type"] == PROBLEM
            assert response.json()["type"] == missing.json()["type"]
        listed = client.get("/v1/jobs").json()["items"]
        assert job_id not in {j["id"] for j in listed}
    with service.client(headers=auth("a")) as client:
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
        assert job_id in {j["id"] for j in client.get("/v1/jobs").json()["items"]}


def test_an_admin_key_sees_every_tenant(service: ServiceProcess, streamed: StreamedJob) -> None:
    job_id = streamed.job["id"]
    with service.client(headers=auth("admin")) as client:
        assert client.get(f"/v1/jobs/{job_id}").status_code == 200
        assert client.get(f"/v1/jobs/{job_id}/artifacts/manifest.json").status_code == 200
        assert job_id in {j["id"] for j in client.get("/v1/jobs").json()["items"]}


def test_offload_figures_name_every_job_so_they_are_admin_only(service: ServiceProcess) -> None:
    with service.client() as client:
        assert client.get("/v1/offload").status_code == 401
        forbidden = client.get("/v1/offload", headers=auth("a"))
        assert forbidden.status_code == 403 and forbidden.json()["type"].endswith("forbidden")
        assert client.get("/v1/offload", headers=auth("admin")).status_code == 200


def test_probes_stay_open(service: ServiceProcess) -> None:
    with service.client() as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200


def test_a_tenant_at_its_active_limit_gets_429_and_others_do_not(
    service: ServiceProcess, root: Path, streamed: StreamedJob
) -> None:
    with service.client(headers=auth("b")) as b, service.client(headers=auth("a")) as a:
        first = b.post("/v1/jobs", json=llama(root))
        assert first.status_code == 202, first.text
        try:
            second = b.post("/v1/jobs", json=llama(root))
            assert second.status_code == 429
            assert second.headers["content-type"] == PROBLEM
            assert int(second.headers["retry-after"]) > 0
            problem = second.json()
            assert problem["type"].endswith("tenant_limit_exceeded")
            assert "tenant b" in problem["detail"] and "limit 1" in problem["detail"]
            other = a.post("/v1/jobs", json=llama(root))  # a's earlier job has finished
            assert other.status_code == 202, other.text
            a.delete(f"/v1/jobs/{other.json()['id']}")
        finally:
            b.delete(f"/v1/jobs/{first.json()['id']}")


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_need_an_admin_key_and_describe_jobs_and_requests(
    service: ServiceProcess, streamed: StreamedJob
) -> None:
    with service.client() as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth("a")).status_code == 403
        response = client.get("/metrics", headers=auth("admin"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = _families(response.text)

    def sample(family: str, name: str, **labels: str) -> float:
        return sum(
            float(s.value) for s in families[family].samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert sample("modelprep_jobs", "modelprep_jobs", status="succeeded", phase="done") >= 1
    assert "modelprep_queue_depth" in families and "modelprep_jobs_running" in families
    assert sample("modelprep_job_phase_duration_seconds",
                  "modelprep_job_phase_duration_seconds_count", phase="export") >= 1
    assert sample("modelprep_job_bytes_written", "modelprep_job_bytes_written_total") > 0
    assert sample("modelprep_job_bytes_read", "modelprep_job_bytes_read_total") > 0
    for name in ("modelprep_job_bytes_downloaded", "modelprep_download_cache_hits",
                 "modelprep_offload_bytes", "modelprep_offload_files",
                 "modelprep_data_dir_free_bytes", "modelprep_job_queue_wait_seconds"):
        assert name in families, name
    assert sample("modelprep_data_dir_free_bytes", "modelprep_data_dir_free_bytes") > 0
    assert sample("modelprep_http_request_duration_seconds",
                  "modelprep_http_request_duration_seconds_count",
                  route="/v1/jobs/{job_id}", status="404") >= 1
    routes = {s.labels.get("route") for s in
              families["modelprep_http_request_duration_seconds"].samples}
    assert not any(r and "f" * 32 in r for r in routes), "job ids never become label values"


def test_logs_are_json_with_ids_and_never_hold_secrets(
    service: ServiceProcess, streamed: StreamedJob
) -> None:
    with service.client(headers={**auth("a"), "X-Request-ID": "trace-me-42"}) as client:
        echoed = client.get(f"/v1/jobs/{streamed.job['id']}")
    assert echoed.headers["x-request-id"] == "trace-me-42"
    lines = service.wait_for_records(
        lambda e: e.get("logger") == "service.access" and e.get("request_id") == "trace-me-42",
        lambda e: e.get("job_id") == streamed.job["id"] and e.get("msg") == "succeeded",
        what="the access line of the traced request and the job's 'succeeded' line",
    )
    text = service.logs()
    for secret in (*KEYS.values(), HF_TOKEN):
        assert secret not in text
    access = [entry for entry in lines if entry["logger"] == "service.access"]
    assert any(e["request_id"] == "trace-me-42" and e["tenant"] == "a" and e["status"] == 200
               for e in access)
    assert all(e["request_id"] and "ms" in e for e in access)
    job_lines = [e for e in lines if e["logger"].startswith("service.jobs.runner")]
    assert job_lines and all(e.get("job_id") for e in job_lines)
    assert any(e.get("job_id") == streamed.job["id"] and e["msg"] == "succeeded" for e in job_lines)


def test_open_service_warns_at_start_up(root: Path, tmp_path: Path) -> None:
    with running_service(tmp_path / "open", [root]) as svc:
        with svc.client() as client:
            assert client.get("/v1/jobs").status_code == 200  # no key needed on loopback
        records = svc.wait_for_records(
            lambda e: "NO API KEYS" in str(e.get("msg")), what="the open-service warning"
        )
        warnings = [e for e in records if "NO API KEYS" in str(e.get("msg"))]
    assert warnings and warnings[0]["level"] == "warning"


def test_open_service_refuses_a_non_loopback_address(tmp_path: Path) -> None:
    env = {"MODELPREP_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--host", "0.0.0.0",
         "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    assert "refusing to serve on 0.0.0.0 without API keys" in result.stderr
    assert "modelprep keygen" in result.stderr


def test_keys_file_is_read_and_a_broken_one_stops_start_up(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(keys_setting())
    env = {"MODELPREP_API_KEYS_FILE": str(keys)}
    with running_service(tmp_path / "data", env=env) as svc, svc.client() as client:
        assert client.get("/v1/jobs").status_code == 401
        assert client.get("/v1/jobs", headers=auth("b")).status_code == 200
    keys.write_text("[{\"tenant\": \"a\", \"sha256\": \"not-a-digest\"}]")
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(free_port())],
        env={"MODELPREP_DATA_DIR": str(tmp_path / "data2"), "MODELPREP_API_KEYS_FILE": str(keys)},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2 and "keys.json is unusable" in result.stderr


def test_client_raises_typed_errors(service: ServiceProcess) -> None:
    from service.errors import ApiError, ServiceUnreachable

    with ModelprepClient(service.url, "mp_wrong") as client, pytest.raises(ApiError) as err:
        client.job("0" * 32)
    assert err.value.http_status == 401
    unreachable = ModelprepClient(f"http://127.0.0.1:{free_port()}")
    with unreachable as client, pytest.raises(ServiceUnreachable):
        client.job("0" * 32)
