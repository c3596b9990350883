"""Completion callbacks end to end: a real server (local pool on SQLite, or an API and a
``modelprep worker`` on PostgreSQL) running real tiny checkpoints, POSTing to a real receiver
on loopback that checks every signature itself (tests/fixtures/callback_receiver.py)."""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.auth import key_digest
from tests.fixtures.callback_receiver import CallbackReceiver, callback_receiver
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.models import build_checkpoint
from tests.fixtures.postgres import fresh_database
from tests.fixtures.service import ServiceProcess, running_service, running_worker
from tests.fixtures.waiting import eventually

__all__ = ["callback_receiver"]

SECRET = "receiver-test-secret-0123456789"
FAST = {
    "MODELPREP_CALLBACK_SECRET": SECRET,
    "MODELPREP_CALLBACK_BACKOFF_SECONDS": "0.2",
    "MODELPREP_CALLBACK_POLL_SECONDS": "0.2",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    return root


def submit(svc: ServiceProcess, body: dict[str, Any],
           headers: dict[str, str] | None = None) -> httpx.Response:
    with svc.client(headers=headers or {}) as client:
        return client.post("/v1/jobs", json=body)


def llama(root: Path, callback_url: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "source": f"file://{root / 'llama'}", "exports": [{"format": "safetensors"}], **extra
    }
    if callback_url is not None:
        body["callback"] = {"url": callback_url}
    return body


def callback_state(svc: ServiceProcess, job_id: str, state: str,
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The job JSON once its callback is in ``state`` (recorded after the receiver answers)."""

    def probe() -> dict[str, Any] | None:
        with svc.client(headers=headers or {}) as client:
            job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        return job if job["callback"]["state"] == state else None

    return eventually(probe, what=f"callback of {job_id} {state}", timeout=60,
                      context=lambda: svc.logs()[-3000:])


def test_a_succeeded_job_posts_its_signed_json_and_is_retried_until_accepted(
    tmp_path: Path, root: Path, callback_receiver: CallbackReceiver
) -> None:
    callback_receiver.fail_first = 2
    with running_service(tmp_path / "data", [root], env=FAST) as svc:
        response = submit(svc, llama(root, callback_receiver.url))
        assert response.status_code == 202, response.text
        accepted = response.json()
        assert accepted["callback"] == {
            "url": callback_receiver.url, "state": "waiting", "attempts": 0,
            "next_attempt_at": None, "last_status_code": None, "last_error": None,
            "delivered_at": None,
        }
        deliveries = callback_receiver.wait_for(3)
        job = callback_state(svc, accepted["id"], "delivered")
    assert [d.answered for d in deliveries] == [500, 500, 204]
    assert all(d.signature_valid for d in deliveries)
    assert [d.headers["X-Modelprep-Attempt"] for d in deliveries] == ["1", "2", "3"]
    body = deliveries[-1].json()
    assert body["id"] == accepted["id"] and body["status"] == "succeeded"
    assert body["artifacts"] == job["artifacts"] and body["artifacts"]
    assert {k: v for k, v in body.items() if k != "callback"} == {
        k: v for k, v in job.items() if k != "callback"
    }
    assert job["callback"]["attempts"] == 3
    assert job["callback"]["last_status_code"] == 204
    assert job["callback"]["delivered_at"] is not None
    assert len(callback_receiver.deliveries) == 3  # delivered: no more attempts


def test_failed_timed_out_and_cancelled_jobs_call_back_too(
    tmp_path: Path, root: Path, callback_receiver: CallbackReceiver, http_server: FileServer
) -> None:
    missing = http_server.add("/gone/model.safetensors", Route(status=404))
    weights = (root / "llama" / "model.safetensors").read_bytes()
    slow = http_server.add("/slow/model.safetensors", Route(body=weights, bytes_per_second=2000))
    with running_service(tmp_path / "data", [root], env=FAST) as svc:
        ids = {}
        cases: dict[str, dict[str, Any]] = {
            "failed": {"source": missing},
            "timed_out": {"source": slow, "timeout": 2},
            "cancelled": {"source": slow},
        }
        for name, case in cases.items():
            body = {"exports": [{"format": "safetensors"}],
                    "callback": {"url": callback_receiver.url}, **case}
            response = submit(svc, body)
            assert response.status_code == 202, response.text
            ids[name] = response.json()["id"]
        svc.wait_for(ids["cancelled"], until={"running"})
        with svc.client() as client:
            assert client.delete(f"/v1/jobs/{ids['cancelled']}").status_code == 202
        callback_receiver.wait_for(3)
        for job_id in ids.values():
            callback_state(svc, job_id, "delivered")
    by_job = {d.json()["id"]: d.json() for d in callback_receiver.deliveries}
    assert all(d.signature_valid for d in callback_receiver.deliveries)
    assert by_job[ids["failed"]]["status"] == "failed"
    assert by_job[ids["failed"]]["error"]["type"] == "source_not_found"
    assert by_job[ids["timed_out"]]["status"] == "failed"
    assert by_job[ids["timed_out"]]["error"]["type"] == "job_timeout"
    assert by_job[ids["cancelled"]]["status"] == "cancelled"


def test_a_slow_receiver_holds_no_job_slot(
    tmp_path: Path, root: Path, callback_receiver: CallbackReceiver
) -> None:
    callback_receiver.hold = threading.Event()
    try:
        env = {**FAST, "MODELPREP_WORKERS": "1"}
        with running_service(tmp_path / "data", [root], env=env) as svc:
            first = submit(svc, llama(root, callback_receiver.url)).json()["id"]
            eventually(lambda: callback_receiver.arrived >= 1, what="first callback POST",
                       timeout=90, context=lambda: svc.logs()[-3000:])
            # The one worker slot is free although the receiver has not answered yet.
            second = submit(svc, llama(root, None)).json()["id"]
            assert svc.wait_for(second)["status"] == "succeeded"
            assert callback_receiver.deliveries == []
            with svc.client() as client:
                assert client.get(f"/v1/jobs/{first}").json()["callback"]["state"] == "pending"
            callback_receiver.hold.set()
            callback_state(svc, first, "delivered")
    finally:
        callback_receiver.hold.set()


def test_a_pending_callback_survives_a_restart_of_the_service(
    tmp_path: Path, root: Path, callback_receiver: CallbackReceiver
) -> None:
    callback_receiver.fail_first = 10_000
    data = tmp_path / "data"
    with running_service(data, [root], env=FAST) as svc:
        job_id = submit(svc, llama(root, callback_receiver.url)).json()["id"]
        callback_receiver.wait_for(2)
    before = len(callback_receiver.deliveries)
    callback_receiver.fail_first = 0
    with running_service(data, [root], env=FAST) as svc:
        job = callback_state(svc, job_id, "delivered")
    assert job["callback"]["attempts"] == before + 1
    assert callback_receiver.deliveries[-1].answered == 204
    assert callback_receiver.deliveries[-1].json()["status"] == "succeeded"


KEYS = {"a": "mp_key_of_tenant_a_0123456789", "b": "mp_key_of_tenant_b_0123456789"}
A_SECRET = "tenant-a-callback-secret-0123456789"


def test_submission_refuses_callbacks_it_could_not_sign_or_may_not_reach(
    tmp_path: Path, root: Path
) -> None:
    receiver = CallbackReceiver(secret=A_SECRET.encode())
    env = {
        "MODELPREP_API_KEYS": json.dumps(
            [{"tenant": t, "sha256": key_digest(k)} for t, k in KEYS.items()]
        ),
        "MODELPREP_CALLBACK_SECRETS": json.dumps({"a": A_SECRET}),
        "MODELPREP_CALLBACK_POLL_SECONDS": "0.2",
    }
    a = {"Authorization": f"Bearer {KEYS['a']}"}
    b = {"Authorization": f"Bearer {KEYS['b']}"}
    with ExitStack() as stack:
        stack.callback(receiver.stop)
        svc = stack.enter_context(running_service(tmp_path / "data", [root], env=env))
        refused = submit(svc, llama(root, receiver.url), headers=b)
        assert refused.status_code == 422
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"].endswith("callback_not_configured")
        for url, problem in {  # the domain's tests try more (test_callback_submission.py)
            "http://169.254.169.254/latest/meta-data": "egress_refused",
            "https://user:pw@example.com/hook": "invalid_request",
        }.items():
            response = submit(svc, llama(root, url), headers=a)
            assert response.status_code == 422, (url, response.text)
            assert response.json()["type"].endswith(problem), (url, response.json())
        with svc.client(headers=b) as client:
            assert client.get("/v1/jobs").json()["items"] == []  # nothing was queued
        accepted = submit(svc, llama(root, receiver.url), headers=a)
        assert accepted.status_code == 202, accepted.text
        [delivery] = receiver.wait_for(1)
        assert delivery.signature_valid, "tenant a's callback must be signed with a's key"
        assert delivery.json()["tenant"] == "a"
        callback_state(svc, accepted.json()["id"], "delivered", headers=a)


@pytest.mark.postgres
def test_a_distributed_worker_delivers_the_callback_with_the_api_stopped(
    tmp_path: Path, root: Path, callback_receiver: CallbackReceiver
) -> None:
    callback_receiver.fail_first = 1
    with fresh_database() as url:
        env = {**FAST, "MODELPREP_EXECUTOR": "procrastinate", "MODELPREP_DATABASE_URL": url,
               "MODELPREP_WORKER_POLL_SECONDS": "0.5"}
        data = tmp_path / "data"
        with running_service(data, [root], env=env) as api:
            response = submit(api, llama(root, callback_receiver.url))
            assert response.status_code == 202, response.text
            job_id = response.json()["id"]
        # Only the worker is left to run the job and deliver its callback.
        with running_worker(data, url, [root], env=env) as worker:
            deliveries = callback_receiver.wait_for(2, timeout=120)
            worker.wait_for_records(
                lambda r: r.get("msg") == "callback delivered" and r.get("job_id") == job_id,
                what="the worker's record of the delivery",
            )
    assert [d.answered for d in deliveries] == [500, 204]
    assert all(d.signature_valid for d in deliveries)
    assert deliveries[-1].json()["status"] == "succeeded"
    assert deliveries[-1].json()["id"] == job_id

