"""A newcomer's first hour against a real ``modelprep serve`` on loopback: errors that say how
to fix them, problem types documented at URLs the service serves, the API's documents, quiet
logs and a prompt stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest

from service.api.problems import catalogue
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.models import build_checkpoint, build_tiny_model, save_checkpoint
from tests.fixtures.service import ServiceProcess, free_port, running_service, service_env
from tests.fixtures.waiting import eventually


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    save_checkpoint(build_tiny_model("llama", 0), root / "no-tokenizer", tokenizer=False)
    return root


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with running_service(tmp_path_factory.mktemp("data"), [root]) as svc:
        yield svc


# --- errors that say how to fix them ------------------------------------------------------


def test_a_source_outside_the_roots_names_the_setting_that_allows_it(
    service: ServiceProcess, tmp_path: Path
) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": f"file://{tmp_path}", "exports": [{"format": "safetensors"}]})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "MODELPREP_LOCAL_ROOTS" in detail and '["/srv/models"]' in detail


def test_a_body_sent_as_a_form_is_told_to_send_json(service: ServiceProcess) -> None:
    """curl -d without -H 'content-type: application/json' sends a form."""
    body = json.dumps({"source": "file:///x", "exports": [{"format": "safetensors"}]})
    with service.client() as client:
        response = client.post(
            "/v1/jobs", content=body,
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert response.status_code == 415
    problem = response.json()
    assert problem["type"] == "/problems/unsupported_media_type"
    assert "content-type: application/json" in problem["detail"]


def test_a_body_sent_without_content_type_is_told_to_send_json(service: ServiceProcess) -> None:
    """requests.post(url, data=json.dumps(...)) sends no content-type header at all."""
    body = json.dumps({"source": "file:///x", "exports": [{"format": "safetensors"}]})
    with service.client() as client:
        request = client.build_request("POST", "/v1/jobs", content=body)
        assert "content-type" not in request.headers
        response = client.send(request)
    assert response.status_code == 415
    problem = response.json()
    assert problem["type"] == "/problems/unsupported_media_type"
    assert "no content-type header" in problem["detail"]
    assert "content-type: application/json" in problem["detail"]


def test_a_quantized_gguf_of_a_checkpoint_without_tokenizer_says_what_works(
    service: ServiceProcess, root: Path
) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": f"file://{root / 'no-tokenizer'}",
            "exports": [{"format": "gguf", "type": "Q4_K_M"}]})
    assert response.status_code == 422
    problem = response.json()
    assert problem["type"] == "/problems/missing_tokenizer"
    assert '"verify": false' in problem["detail"] and "q8_0" in problem["detail"]
    page = httpx.get(urljoin(str(response.url), problem["type"]), timeout=30)
    assert page.status_code == 200
    assert '"verify": false' in page.text.replace("&quot;", '"')
    assert "tokenizer.json" in page.text


@pytest.mark.parametrize(
    ("setting", "value", "example"),
    [
        ("MODELPREP_LOCAL_ROOTS", "/srv/models", '["/srv/models"]'),
        ("MODELPREP_WORKERS", "two", "MODELPREP_WORKERS="),
        ("MODELPREP_ARTIFACT_TTL", "3 days", "30d"),
    ],
)
def test_a_malformed_setting_is_one_line_naming_it_with_an_example(
    tmp_path: Path, setting: str, value: str, example: str
) -> None:
    env = service_env(tmp_path, None, {setting: value})
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(free_port())],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert setting in lines[0] and example in lines[0], lines[0]


# --- problem types the service documents itself --------------------------------------------


def test_every_problem_type_resolves_to_a_page_of_the_service(service: ServiceProcess) -> None:
    with service.client() as client:
        missing = client.get(f"/v1/jobs/{'0' * 32}")
        assert missing.status_code == 404
        page = client.get(urljoin(str(missing.url), missing.json()["type"]))
        assert page.status_code == 200 and "job_not_found" in page.text
        index = client.get("/problems")
        assert index.status_code == 200
        for code, problem in catalogue().items():
            described = client.get(f"/problems/{code}")
            assert described.status_code == 200, code
            assert f"<code>{code}</code>" in described.text and f'href="/problems/{code}"' in (
                index.text
            )
            assert problem.fix or problem.meaning, code
        assert client.get("/problems/no_such_problem").status_code == 404


# --- the API's documents -------------------------------------------------------------------


def test_the_root_leads_to_the_operators_page(service: ServiceProcess) -> None:
    with service.client() as client:
        response = client.get("/")
    assert response.status_code in (302, 307, 308)
    assert response.headers["location"].rstrip("/") == "/ui"


def test_the_docs_page_names_no_other_host(service: ServiceProcess) -> None:
    with service.client() as client:
        page = client.get("/docs")
        assert page.status_code == 200
        assert "http://" not in page.text and "https://" not in page.text and "//" not in (
            page.text.replace("://", "")
        )
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            assert f"/docs/static/{asset}" in page.text
            assert client.get(f"/docs/static/{asset}").status_code == 200
        assert client.get("/docs/static/../../etc/passwd").status_code == 404
        redoc = client.get("/redoc")
        assert redoc.status_code == 200 and "/docs/static/redoc.standalone.js" in redoc.text
        assert "https://" not in redoc.text and "http://" not in redoc.text


def test_every_request_field_has_a_description(service: ServiceProcess) -> None:
    with service.client() as client:
        document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    submit = document["paths"]["/v1/jobs"]["post"]
    assert submit.get("description") and submit["requestBody"]["content"][
        "application/json"].get("examples"), "POST /v1/jobs needs a description and examples"
    request_schemas = ["JobCreate", "CallbackSpec", "GGUFImatrix"] + [
        name for name in schemas if name.endswith("Spec") and name != "ExportSpec"
    ]
    missing = [
        f"{name}.{field}"
        for name in request_schemas if name in schemas
        for field, prop in schemas[name].get("properties", {}).items()
        if field != "format" and not prop.get("description")
    ]
    assert not missing, f"request fields without a description: {missing}"


def test_the_schema_documents_the_spellings_it_accepts(service: ServiceProcess) -> None:
    with service.client() as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "bf16" in schemas["SafetensorsSpec"]["properties"]["dtype"]["description"]
    assert "q4_k_m is Q4_K_M" in schemas["GGUFSpec"]["properties"]["type"]["description"]


# --- quiet logs and a prompt stop ----------------------------------------------------------


def test_the_log_has_no_plugin_chatter_nor_terminal_colours(service: ServiceProcess) -> None:
    logs = service.logs()
    records = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert records, logs[:2000]
    assert not [r for r in records if r["logger"] == "alembic.runtime.plugins"]
    assert not [r for r in records if "color_message" in r]
    assert "\x1b[" not in logs and "\\u001b" not in logs


@contextmanager
def _serve(data: Path, roots: list[Path]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``modelprep serve`` on a free port, ready; killed on the way out if still running, so a
    failed test leaves no service behind."""
    port = free_port()
    env = service_env(data, roots, None)
    data.mkdir(parents=True, exist_ok=True)
    with (data / "service.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
            env=env, cwd=data, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, (data / "service.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        eventually(ready, what="the service answers /readyz", timeout=120)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _stop_seconds(process: subprocess.Popen[bytes]) -> float:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    return time.monotonic() - started


def test_sigterm_stops_an_idle_service_in_under_a_second(tmp_path: Path) -> None:
    """At once after it is ready (the job process server may still be importing torch) and
    once it has settled."""
    with _serve(tmp_path / "a", []) as (process, _):
        assert _stop_seconds(process) < 1.0
    with _serve(tmp_path / "b", []) as (process, _):
        time.sleep(3)
        assert _stop_seconds(process) < 1.0


def test_sigterm_with_a_running_job_stops_it_and_a_restart_runs_it_again(
    tmp_path: Path, root: Path, http_server: FileServer
) -> None:
    """As documented: the running job's process group is killed; the job stays ``running`` in
    the store and the next start re-queues it (``attempts`` counts it)."""
    weights = (root / "llama" / "model.safetensors").read_bytes()
    source = http_server.add("/slow/model.safetensors",
                             Route(body=weights, bytes_per_second=40_000))
    data = tmp_path / "data"
    with _serve(data, [root]) as (process, url):
        job_id = httpx.post(f"{url}/v1/jobs", json={
            "source": source, "exports": [{"format": "safetensors"}]}, timeout=30).json()["id"]
        eventually(lambda: httpx.get(f"{url}/v1/jobs/{job_id}", timeout=5).json()["phase"]
                   == "download", what="the job runs (downloading)", timeout=180)
        assert _stop_seconds(process) < 5.0
    leftovers = subprocess.run(["pgrep", "-f", f"modelprep-job-{job_id}"], capture_output=True,
                               text=True, check=False).stdout
    assert not leftovers.strip(), "the job's process outlived the service"
    # The trickle only had to keep the first run downloading until the stop; the re-queued run
    # reads the same bytes (same ETag) at full speed rather than for another ~9 s.
    http_server.add("/slow/model.safetensors", Route(body=weights))
    with _serve(data, [root]) as (process, url):

        def ended() -> bool:
            job = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=5).json()
            return bool(job["status"] in ("succeeded", "failed", "cancelled"))

        eventually(ended, what="the re-queued job ends", timeout=240)
        job = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=5).json()
        assert job["status"] == "succeeded" and job["attempts"] == 2, job
        _stop_seconds(process)
    assert os.path.exists(data / "modelprep.db")
