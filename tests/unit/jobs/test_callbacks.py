"""Completion callbacks against a real job store (SQLite and PostgreSQL) and a real HTTP
receiver on loopback that checks the signature itself and fails when told to."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from service.api.schemas import job_json
from service.config import Settings
from service.jobs.callbacks import (
    SIGNATURE_HEADER,
    CallbackDeliverer,
    backoff_seconds,
    sign,
    verify_signature,
)
from service.jobs.model import CallbackDelivery, CallbackState, Job, JobError, JobStatus
from service.jobs.store import JobStore, utcnow
from tests.fixtures.callback_receiver import CallbackReceiver, callback_receiver
from tests.fixtures.waiting import eventually
from tests.unit.jobs.test_store import new_job, store
from tests.unit.jobs.test_totals import scrape

__all__ = ["callback_receiver", "store"]

SECRET = b"receiver-test-secret-0123456789"


def settings_for(tmp_path: Path, **changes: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": tmp_path,
        "callback_secret": SECRET.decode(),
        "callback_secrets": {"acme": "acme-secret-0123456789abcdef"},
        "egress_allowlist": ["127.0.0.0/8"],
        "callback_backoff_seconds": 0.2,
        "callback_timeout_seconds": 5,
    }
    values.update(changes)
    return Settings(**values)


def job_with_callback(url: str, tenant: str | None = None) -> Job:
    job = new_job(tenant=tenant)
    return job.replace(
        spec={**job.spec, "callback": {"url": url}},
        callback=CallbackDelivery(url=url, state=CallbackState.WAITING),
    )


def ended(store: JobStore, job: Job, status: JobStatus = JobStatus.SUCCEEDED) -> Job:
    store.claim(job.id, "test:1")
    error = None if status is JobStatus.SUCCEEDED else JobError("job_cancelled", "by request")
    assert store.finish(job.id, status, error=error)
    return store.get(job.id)


def deliver_until(deliverer: CallbackDeliverer, store: JobStore, job_id: str,
                  state: CallbackState, timeout: float = 30) -> Job:
    """Delivery passes (as the deliverer's thread makes them) until the callback is in
    ``state``."""

    def probe() -> Job | None:
        deliverer.deliver_due()
        job = store.get(job_id)
        assert job.callback is not None
        return job if job.callback.state is state else None

    return eventually(probe, what=f"callback {state.value}", timeout=timeout)


@pytest.fixture
def deliverers() -> Iterator[list[CallbackDeliverer]]:
    made: list[CallbackDeliverer] = []
    yield made
    for deliverer in made:
        deliverer.stop()


def make(deliverers: list[CallbackDeliverer], settings: Settings, store: JobStore
         ) -> CallbackDeliverer:
    deliverer = CallbackDeliverer(settings, store, render=job_json)
    deliverers.append(deliverer)
    return deliverer


# --- signatures --------------------------------------------------------------------------------


def test_signature_verifies_only_the_exact_body_recent_timestamp_and_key() -> None:
    body = b'{"id":"x","status":"succeeded"}'
    now = int(time.time())
    header = sign(SECRET, now, body)
    assert header.startswith(f"t={now},v1=")
    assert verify_signature(header, body, SECRET)
    assert not verify_signature(header, body + b" ", SECRET)
    assert not verify_signature(header, body, b"another-secret-0123456789")
    assert not verify_signature(header.replace(f"t={now}", f"t={now - 1}"), body, SECRET)
    old = sign(SECRET, now - 301, body)
    assert not verify_signature(old, body, SECRET), "a replay after 5 minutes must be refused"
    assert not verify_signature("garbage", body, SECRET)


def test_backoff_doubles_then_caps_and_honours_retry_after_within_the_cap(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, callback_backoff_seconds=2, callback_backoff_max_seconds=60)
    assert [backoff_seconds(settings, n) for n in (1, 2, 3, 4, 5, 6, 7)] == [
        2, 4, 8, 16, 32, 60, 60
    ]
    assert backoff_seconds(settings, 1, retry_after=30) == 30
    assert backoff_seconds(settings, 1, retry_after=3600) == 60


# --- store state -------------------------------------------------------------------------------


def test_a_callback_waits_while_the_job_runs_and_is_due_from_the_write_that_ends_it(
    store: JobStore,
) -> None:
    job = store.create(job_with_callback("http://127.0.0.1:9/hook"))
    assert store.get(job.id).callback == CallbackDelivery(
        url="http://127.0.0.1:9/hook", state=CallbackState.WAITING
    )
    assert store.due_callbacks(utcnow(), 10) == []
    done = ended(store, job, JobStatus.CANCELLED)
    assert done.callback is not None
    assert done.callback.state is CallbackState.PENDING
    assert done.callback.next_attempt_at is not None
    assert store.due_callbacks(utcnow() + timedelta(seconds=1), 10) == [job.id]


def test_a_job_without_callback_never_becomes_due(store: JobStore) -> None:
    job = store.create(new_job())
    done = ended(store, job)
    assert done.callback is None
    assert store.due_callbacks(utcnow() + timedelta(days=1), 10) == []


def test_one_attempt_is_claimed_by_one_deliverer_only(store: JobStore) -> None:
    job = ended(store, store.create(job_with_callback("http://127.0.0.1:9/hook")))
    now = utcnow() + timedelta(seconds=1)
    lease = now + timedelta(seconds=60)
    results: list[Job | None] = []
    threads = [threading.Thread(target=lambda: results.append(
        store.claim_callback(job.id, now, lease))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [r for r in results if r is not None]
    assert len(claimed) == 1
    assert claimed[0].callback is not None and claimed[0].callback.attempts == 1


# --- delivery to a real receiver ---------------------------------------------------------------


def test_the_job_json_is_posted_signed_and_recorded_delivered(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    deliverer = make(deliverers, settings_for(tmp_path), store)
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    done = deliver_until(deliverer, store, job.id, CallbackState.DELIVERED)
    [delivery] = callback_receiver.deliveries
    assert delivery.signature_valid, delivery.headers
    assert delivery.answered == 204
    assert delivery.headers["Content-Type"] == "application/json"
    assert delivery.headers["X-Modelprep-Job-Id"] == job.id
    assert delivery.headers["X-Modelprep-Attempt"] == "1"
    body = delivery.json()
    assert body["id"] == job.id and body["status"] == "succeeded"
    assert body["request"]["callback"] == {"url": callback_receiver.url}
    assert body["callback"]["state"] == "pending" and body["callback"]["attempts"] == 1
    # The same document GET /v1/jobs/{id} gives, but for the delivery state that moved on.
    now = json.loads(job_json(done))
    assert {k: v for k, v in body.items() if k != "callback"} == {
        k: v for k, v in now.items() if k != "callback"
    }
    assert done.callback is not None
    assert done.callback.attempts == 1
    assert done.callback.last_status_code == 204
    assert done.callback.last_error is None
    assert done.callback.next_attempt_at is None
    assert done.callback.delivered_at is not None
    assert store.due_callbacks(utcnow() + timedelta(days=1), 10) == []


def test_a_tenants_callback_is_signed_with_that_tenants_key(
    store: JobStore, tmp_path: Path, deliverers: list[CallbackDeliverer],
) -> None:
    receiver = CallbackReceiver(secret=b"acme-secret-0123456789abcdef")
    try:
        deliverer = make(deliverers, settings_for(tmp_path), store)
        job = ended(store, store.create(job_with_callback(receiver.url, tenant="acme")))
        deliver_until(deliverer, store, job.id, CallbackState.DELIVERED)
        [delivery] = receiver.deliveries
        assert delivery.signature_valid
        assert not verify_signature(delivery.headers[SIGNATURE_HEADER], delivery.body, SECRET), (
            "the service's open-mode key must not sign a tenant's callback"
        )
    finally:
        receiver.stop()


def test_failed_attempts_are_retried_with_backoff_until_delivered(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    callback_receiver.fail_first = 2
    deliverer = make(deliverers, settings_for(tmp_path, callback_backoff_seconds=0.3), store)
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    deliverer.deliver_due()
    after_first = store.get(job.id).callback
    assert after_first is not None
    assert after_first.state is CallbackState.PENDING
    assert after_first.attempts == 1
    assert after_first.last_status_code == 500
    assert after_first.last_error == "answered HTTP 500"
    assert after_first.next_attempt_at is not None
    done = deliver_until(deliverer, store, job.id, CallbackState.DELIVERED)
    deliveries = callback_receiver.deliveries
    assert [d.answered for d in deliveries] == [500, 500, 204]
    assert [d.headers["X-Modelprep-Attempt"] for d in deliveries] == ["1", "2", "3"]
    assert all(d.signature_valid for d in deliveries)
    gaps = [b.received_at - a.received_at for a, b in itertools.pairwise(deliveries)]
    assert gaps[0] >= 0.3 * 0.9 and gaps[1] >= 0.6 * 0.9, gaps  # 0.3 s, then doubled
    assert done.callback is not None and done.callback.attempts == 3


def test_a_callback_fails_after_its_last_attempt(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    callback_receiver.fail_first = 100
    callback_receiver.fail_status = 503
    settings = settings_for(tmp_path, callback_backoff_seconds=0.05, callback_max_attempts=3)
    deliverer = make(deliverers, settings, store)
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    done = deliver_until(deliverer, store, job.id, CallbackState.FAILED)
    assert done.callback is not None
    assert done.callback.attempts == 3
    assert done.callback.last_status_code == 503
    assert done.callback.next_attempt_at is None
    assert len(callback_receiver.deliveries) == 3
    time.sleep(0.2)
    assert deliverer.deliver_due() == 0


def test_retry_after_of_a_429_delays_the_next_attempt(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    callback_receiver.fail_first = 1
    callback_receiver.fail_status = 429
    callback_receiver.fail_headers = {"Retry-After": "30"}
    deliverer = make(deliverers, settings_for(tmp_path, callback_backoff_seconds=0.05), store)
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    before = utcnow()
    deliverer.deliver_due()
    callback = store.get(job.id).callback
    assert callback is not None and callback.next_attempt_at is not None
    assert callback.next_attempt_at >= before + timedelta(seconds=29)


def test_an_unreachable_receiver_is_retried_with_the_connection_error_recorded(
    store: JobStore, tmp_path: Path, deliverers: list[CallbackDeliverer],
) -> None:
    receiver = CallbackReceiver(secret=SECRET)
    url = receiver.url
    receiver.stop()  # nothing listens on that port any more
    deliverer = make(deliverers, settings_for(tmp_path), store)
    job = ended(store, store.create(job_with_callback(url)))
    assert deliverer.deliver_due() == 1
    callback = store.get(job.id).callback
    assert callback is not None
    assert callback.state is CallbackState.PENDING
    assert callback.last_status_code is None
    assert callback.last_error is not None and "ConnectError" in callback.last_error


def test_a_name_that_does_not_resolve_is_retried_not_failed(
    store: JobStore, tmp_path: Path, deliverers: list[CallbackDeliverer],
) -> None:
    deliverer = make(deliverers, settings_for(tmp_path), store)
    job = ended(store, store.create(job_with_callback("http://receiver.invalid/hook")))
    assert deliverer.deliver_due() == 1
    callback = store.get(job.id).callback
    assert callback is not None and callback.state is CallbackState.PENDING
    assert callback.last_error is not None
    assert callback.last_error.startswith("ConnectError: host 'receiver.invalid' does not resolve")


def test_the_egress_policy_is_checked_on_the_address_connected_to_at_delivery(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    # "localhost" passes the submission check (not a literal); it resolves to loopback.
    url = callback_receiver.url.replace("127.0.0.1", "localhost")
    deliverer = make(deliverers, settings_for(tmp_path, egress_allowlist=[]), store)
    job = ended(store, store.create(job_with_callback(url)))
    done = deliver_until(deliverer, store, job.id, CallbackState.FAILED)
    assert done.callback is not None
    assert done.callback.last_error is not None
    assert done.callback.last_error.startswith("egress_refused: ")
    assert done.callback.attempts == 1
    assert callback_receiver.deliveries == []


def test_an_attempt_whose_deliverer_died_is_retried_once_its_lease_runs_out(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    now = utcnow()
    # A deliverer took attempt 1 with a short lease, then died before recording anything.
    assert store.claim_callback(job.id, now, now + timedelta(seconds=0.5)) is not None
    deliverer = make(deliverers, settings_for(tmp_path), store)
    assert deliverer.deliver_due() == 0, "the lease still holds"
    done = deliver_until(deliverer, store, job.id, CallbackState.DELIVERED)
    assert done.callback is not None and done.callback.attempts == 2
    [delivery] = callback_receiver.deliveries
    assert delivery.headers["X-Modelprep-Attempt"] == "2"


def test_a_callback_whose_attempts_keep_dying_is_failed_after_its_last_one(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    for _ in range(2):  # two deliverers died mid-POST; their leases are over at once
        now = utcnow()
        assert store.claim_callback(job.id, now, now) is not None
    deliverer = make(deliverers, settings_for(tmp_path, callback_max_attempts=2), store)
    assert deliverer.deliver_due() == 1
    callback = store.get(job.id).callback
    assert callback is not None and callback.state is CallbackState.FAILED
    assert callback.attempts == 3
    assert callback_receiver.deliveries == []


def test_a_crash_while_rendering_costs_one_attempt_not_the_deliverer(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
) -> None:
    def broken(job: Job) -> bytes:
        raise RuntimeError("a bug")

    deliverer = CallbackDeliverer(settings_for(tmp_path), store, render=broken)
    try:
        job = ended(store, store.create(job_with_callback(callback_receiver.url)))
        assert deliverer.deliver_due() == 1
        callback = store.get(job.id).callback
        assert callback is not None and callback.state is CallbackState.PENDING
        assert callback.last_error == "internal error: RuntimeError"
        assert callback.next_attempt_at is not None
    finally:
        deliverer.stop()


def test_a_stale_attempts_outcome_does_not_overwrite_the_newer_one(store: JobStore) -> None:
    job = ended(store, store.create(job_with_callback("http://127.0.0.1:9/hook")))
    now = utcnow() + timedelta(seconds=1)
    assert store.claim_callback(job.id, now, now) is not None  # attempt 1, lease over at once
    assert store.claim_callback(job.id, now, now + timedelta(seconds=60)) is not None  # 2
    assert not store.record_callback(job.id, 1, CallbackState.FAILED, status_code=500,
                                     error="late")
    assert store.record_callback(job.id, 2, CallbackState.DELIVERED, status_code=200,
                                 error=None)
    callback = store.get(job.id).callback
    assert callback is not None and callback.state is CallbackState.DELIVERED


def test_the_deliverers_thread_delivers_without_being_asked(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    deliverer = make(deliverers, settings_for(tmp_path, callback_poll_seconds=0.1), store)
    deliverer.start()
    job = ended(store, store.create(job_with_callback(callback_receiver.url)))
    callback_receiver.wait_for(1, timeout=30)

    def delivered() -> bool:
        callback = store.get(job.id).callback
        return callback is not None and callback.state is CallbackState.DELIVERED

    eventually(delivered, what="delivered state recorded", timeout=30)


def test_metrics_count_attempts_and_outcomes_and_show_the_backlog(
    store: JobStore, tmp_path: Path, callback_receiver: CallbackReceiver,
    deliverers: list[CallbackDeliverer],
) -> None:
    callback_receiver.fail_first = 1
    deliverer = make(deliverers, settings_for(tmp_path, callback_max_attempts=1,
                                              callback_backoff_seconds=0.05), store)
    failing = ended(store, store.create(job_with_callback(callback_receiver.url)))
    deliver_until(deliverer, store, failing.id, CallbackState.FAILED)
    waiting = ended(store, store.create(job_with_callback(callback_receiver.url)))
    before = scrape(store, tmp_path)
    assert before["modelprep_callbacks_pending{}"] == 1
    assert before["modelprep_callback_lag_seconds{}"] >= 0
    deliver_until(deliverer, store, waiting.id, CallbackState.DELIVERED)
    after = scrape(store, tmp_path)
    assert after["modelprep_callback_attempts_total{}"] == 2
    assert after["modelprep_callbacks_total{outcome=delivered}"] == 1
    assert after["modelprep_callbacks_total{outcome=failed}"] == 1
    assert after["modelprep_callbacks_pending{}"] == 0
    assert after["modelprep_callback_lag_seconds{}"] == 0
