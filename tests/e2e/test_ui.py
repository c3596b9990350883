"""The operator's page in a real headless Chromium against a real ``modelprep serve``.

One service and one browser for the whole story (both are the slow part): a tenant signs in,
gets the API's validation errors next to the form fields, submits a tiny real checkpoint, watches
the job reach ``succeeded`` through the SSE stream, downloads an artifact (checked against the
API's sha256), and a second tenant sees neither the job in its list nor the job's page.

Screenshots go to ``MODELPREP_UI_SCREENSHOTS`` when set (the README's docs/ui-*.png are made
that way), else to the test's temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from service.api.auth import key_digest
from tests.fixtures.browser import headless_chromium
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.models import build_checkpoint
from tests.fixtures.service import TERMINAL, ServiceProcess, running_service
from tests.unit.test_grafana_dashboard import dashboard_metrics, load_dashboard

KEYS = {"alice": "mp_ui-test-alice", "bob": "mp_ui-test-bob", "ops": "mp_ui-test-ops"}
JOB_TIMEOUT_MS = 180_000  # a loaded 2-core CI machine queues the child process for a while


@pytest.fixture(scope="module")
def ui_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("ui")
    build_checkpoint(root / "models" / "tiny-llama")
    keys = [
        {"tenant": "alice", "sha256": key_digest(KEYS["alice"])},
        {"tenant": "bob", "sha256": key_digest(KEYS["bob"])},
        {"tenant": "ops", "sha256": key_digest(KEYS["ops"]), "admin": True},
    ]
    env = {
        "MODELPREP_API_KEYS": json.dumps(keys),
        "MODELPREP_EGRESS_ALLOWLIST": '["127.0.0.1"]',  # the slow loopback source to cancel
    }
    with running_service(root / "data", local_roots=[root / "models"], env=env) as service:
        yield service


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with headless_chromium() as browser:
        yield browser


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    return Path(os.environ.get("MODELPREP_UI_SCREENSHOTS") or tmp_path)


def sign_in(browser: Browser, service: ServiceProcess, who: str, requests: list[str]) -> Page:
    page = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 800}).new_page()
    page.on("request", lambda request: requests.append(request.url))
    page.goto(f"{service.url}/ui")
    page.fill("#api-key", KEYS[who])
    page.click("#signin button[type=submit]")
    expect(page.locator("#who")).to_have_text("admin key" if who == "ops" else "tenant key")
    return page


def test_a_tenant_submits_watches_and_downloads_and_another_tenant_sees_nothing(
    browser: Browser, ui_service: ServiceProcess, shots: Path
) -> None:
    requests: list[str] = []
    alice = sign_in(browser, ui_service, "alice", requests)
    assert alice.evaluate("sessionStorage.getItem('modelprep.key')") == KEYS["alice"]

    # The API's own validation errors, next to the fields they name.
    alice.click("a[data-nav=submit]")
    alice.fill("#f-source", "")
    alice.fill("#f-max_memory", "lots")
    alice.fill("input[name=options-safetensors]", '{"bogus_option": 1}')
    alice.click("#submit-form button[type=submit]")
    expect(alice.locator("#error-max_memory")).to_contain_text("invalid size 'lots'")
    expect(alice.locator("#error-source")).to_contain_text("at least 1 character")
    expect(alice.locator("#error-exports-safetensors")).to_contain_text(
        "bogus_option: Extra inputs are not permitted"
    )
    alice.screenshot(path=str(shots / "ui-submit-errors.png"), full_page=True)

    # A valid job: the page moves to the job, which goes live to succeeded over the SSE stream.
    source = f"file://{ui_service.data_dir.parent / 'models' / 'tiny-llama'}"
    alice.fill("#f-source", source)
    alice.fill("#f-max_memory", "")
    alice.fill("input[name=options-safetensors]", "")
    alice.click("#submit-form button[type=submit]")
    alice.wait_for_url(re.compile(r"#/jobs/[0-9a-f]+$"))
    job_id = alice.url.rsplit("/", 1)[-1]
    first_status = alice.locator("#job-status").inner_text()
    expect(alice.locator("#job-status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    assert first_status in {"queued", "running", "succeeded"}
    assert any(url.endswith(f"/v1/jobs/{job_id}/events") for url in requests), (
        "the job page did not follow the job's SSE stream"
    )
    expect(alice.locator("tr.verify")).to_contain_text("safetensors")
    expect(alice.locator("a.download", has_text="model.safetensors")).to_be_visible()
    alice.screenshot(path=str(shots / "ui-job.png"), full_page=True)

    # Download an artifact through fetch + blob, with the key in a header: same bytes as the API.
    with alice.expect_download() as info:
        alice.click("a.download[data-path='safetensors/model.safetensors']")
    downloaded = Path(info.value.path()).read_bytes()
    with ui_service.client(headers={"Authorization": f"Bearer {KEYS['alice']}"}) as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
    expected = next(a for a in job["artifacts"] if a["path"] == "safetensors/model.safetensors")
    assert hashlib.sha256(downloaded).hexdigest() == expected["sha256"]

    # Delete the finished job's files from its page: the artifacts go, their URLs answer 410.
    alice.on("dialog", lambda dialog: dialog.accept())
    alice.click("#delete")
    expect(alice.locator("#deleted")).to_contain_text("files deleted", timeout=JOB_TIMEOUT_MS)
    expect(alice.locator("a.download")).to_have_count(0)
    with ui_service.client(headers={"Authorization": f"Bearer {KEYS['alice']}"}) as client:
        gone = client.get(f"/v1/jobs/{job_id}/artifacts/safetensors/model.safetensors")
        assert gone.status_code == 410, gone.text
        assert client.get(f"/v1/jobs/{job_id}").json()["artifacts"] == []

    # The list shows the job to its tenant, filterable by status.
    alice.goto(f"{ui_service.url}/ui/#/jobs?status=succeeded")
    expect(alice.locator(f"tr[data-job-id='{job_id}'] td.status")).to_have_text("succeeded")
    alice.goto(f"{ui_service.url}/ui/#/jobs?status=failed")
    expect(alice.locator("#jobs tbody")).to_contain_text("No jobs.")
    expect(alice.locator(f"tr[data-job-id='{job_id}']")).to_have_count(0)

    # Another tenant: not in its list, and the job's page answers like a job that does not exist.
    bob = sign_in(browser, ui_service, "bob", requests)
    expect(bob.locator("#jobs tbody")).to_contain_text("No jobs.")
    expect(bob.locator(f"tr[data-job-id='{job_id}']")).to_have_count(0)
    assert bob.locator("#nav-offload").is_hidden()
    bob.goto(f"{ui_service.url}/ui/#/jobs/{job_id}")
    expect(bob.locator(".problem")).to_contain_text(f"no job {job_id}")

    # An admin sees the tenant column and the offload page.
    ops = sign_in(browser, ui_service, "ops", requests)
    expect(ops.locator(f"tr[data-job-id='{job_id}']")).to_contain_text("alice")
    ops.screenshot(path=str(shots / "ui-jobs.png"), full_page=True)
    ops.click("#nav-offload")
    expect(ops.locator("main h1")).to_have_text("Offload directory")
    expect(ops.locator("main")).to_contain_text("free disk")
    ops.screenshot(path=str(shots / "ui-offload.png"), full_page=True)

    # No key ever travelled in a URL.
    leaked = [url for url in requests for key in KEYS.values() if key in url]
    assert not leaked, leaked


def test_a_tenant_cancels_a_running_job_from_its_page(
    browser: Browser, ui_service: ServiceProcess, http_server: FileServer
) -> None:
    """A download trickling at 20 kB/s keeps the job running until the Cancel button stops it."""
    weights = (ui_service.data_dir.parent / "models" / "tiny-llama" / "model.safetensors").read_bytes()
    url = http_server.add("/slow/model.safetensors", Route(body=weights, bytes_per_second=20_000))
    with ui_service.client(headers={"Authorization": f"Bearer {KEYS['alice']}"}) as client:
        response = client.post("/v1/jobs", json={"source": url, "exports": [{"format": "safetensors"}]})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    alice = sign_in(browser, ui_service, "alice", [])
    alice.goto(f"{ui_service.url}/ui/#/jobs/{job_id}")
    expect(alice.locator("#job-phase")).to_have_text("download", timeout=JOB_TIMEOUT_MS)
    alice.click("#cancel")
    expect(alice.locator("#job-status")).to_have_text("cancelled", timeout=30_000)
    expect(alice.locator("#cancel")).to_have_count(0)


def test_ui_files_are_served_with_a_same_origin_policy_and_nothing_else(
    ui_service: ServiceProcess,
) -> None:
    with httpx.Client(base_url=ui_service.url, timeout=30) as client:
        index = client.get("/ui/")
        assert index.status_code == 200
        assert "script-src 'self'" in index.headers["content-security-policy"]
        assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
        for escape in ("/ui/..%2Fapp.py", "/ui/%2e%2e%2fauth.py", "/ui/nothing.js"):
            response = client.get(escape)
            assert response.status_code == 404, escape
            assert response.headers["content-type"] == "application/problem+json"


def test_the_dashboard_queries_only_metrics_the_service_exports(
    ui_service: ServiceProcess,
) -> None:
    """Every metric in deploy/grafana's panels is in a real scrape.

    Per-phase and per-outcome series exist once a job has finished: run one unless an earlier
    test of this module already did (so the test also holds when run alone)."""
    with ui_service.client(headers={"Authorization": f"Bearer {KEYS['ops']}"}) as client:
        if not client.get("/v1/jobs", params={"status": "succeeded"}).json()["items"]:
            source = f"file://{ui_service.data_dir.parent / 'models' / 'tiny-llama'}"
            submitted = client.post(
                "/v1/jobs", json={"source": source, "exports": [{"format": "safetensors"}]}
            )
            assert submitted.status_code == 202, submitted.text
            job_url = submitted.headers["Location"]
            deadline = time.monotonic() + JOB_TIMEOUT_MS / 1000
            while (job := client.get(job_url).json())["status"] not in TERMINAL:
                assert time.monotonic() < deadline, f"job still {job['status']}"
                time.sleep(0.2)
            assert job["status"] == "succeeded", job
        scrape = client.get("/metrics")
    assert scrape.status_code == 200, scrape.text
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in scrape.text.splitlines()
        if line.startswith("modelprep_")
    }
    queried = dashboard_metrics(load_dashboard())
    assert queried, "the dashboard queries nothing"
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics the service does not export: {missing}"
