"""Completion callbacks: when a job ends, POST its JSON to the URL it was submitted with.

Platform code should not have to poll. A job submitted with ``"callback": {"url": ...}`` is
POSTed, once it reaches a terminal status (succeeded, failed, cancelled, or failed with
``job_timeout``), the document ``GET /v1/jobs/{id}`` gives, signed so the receiver can tell it
from a forgery.

**Signature.** Header ``X-Modelprep-Signature: t=<unix seconds>,v1=<hex>`` where ``<hex>`` is
HMAC-SHA256, keyed with the tenant's secret (``MODELPREP_CALLBACK_SECRETS``; in open mode the
service's ``MODELPREP_CALLBACK_SECRET``), of ``<t>.`` followed by the exact body bytes (the
scheme Stripe uses). The timestamp is signed too, so a receiver that refuses a ``t`` older than a
few minutes is safe from replays; each attempt is signed afresh. :func:`verify_signature` is the
receiver's side. Other headers: ``X-Modelprep-Job-Id`` and ``X-Modelprep-Attempt``.

**Delivery.** At least once. The delivery state lives on the job's row (``callback_*``
columns; its SQL is :mod:`service.jobs.store.callbacks`): the write that ends the job makes a
waiting callback due, whichever process ends it (job child, pool, worker, a cancel in the API). A
:class:`CallbackDeliverer` runs in every API process and every ``modelprep worker``, outside
any job slot: it looks for due callbacks every ``callback_poll_seconds``, takes one with a lease
(one guarded UPDATE, so two deliverers never send the same attempt), POSTs it, and records the
answer. A 2xx answer delivers it; anything else (another status, a timeout, a refused
connection) schedules a retry after ``callback_backoff_seconds`` doubling per attempt, capped by
``callback_backoff_max_seconds`` (a ``Retry-After`` of a 429 or 503 is honoured within that
cap), until ``callback_max_attempts``; then it fails. A deliverer that dies mid-POST leaves a
lease that runs out, and the attempt is retried by whoever looks next, after a restart too.
Redirects are not followed (a 3xx is a failed attempt): the URL must be the receiver's.

**Egress.** The URL is checked at submission when its host is a literal address, and the
address actually connected to is checked at every attempt (service/egress.py); a refused
destination fails the callback at once, with ``egress_refused`` as its last error (a name that
does not resolve is retried: DNS may be down for a moment). The POST goes through the
settings' proxy (a receiver the policy refuses is refused before the proxy is asked) and is
verified with their CA bundle; a receiver whose certificate that bundle does not trust is
retried with ``certificate_untrusted`` as its last error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime

import httpx

from service.config import Settings
from service.egress import egress_client, system_resolver
from service.errors import CallbackNotConfigured, CertificateUntrusted, EgressRefused
from service.jobs.model import CallbackDelivery, CallbackState, Job
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore, utcnow
from service.retry import Backoff

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Modelprep-Signature"
JOB_ID_HEADER = "X-Modelprep-Job-Id"
ATTEMPT_HEADER = "X-Modelprep-Attempt"
SIGNATURE_TOLERANCE_SECONDS = 300
"""How old a signature's timestamp :func:`verify_signature` accepts by default."""

BATCH = 64
"""Due callbacks one pass takes at most."""
STOP_GRACE_SECONDS = 5.0
"""How long stopping waits for attempts in flight."""

RenderJob = Callable[[Job], bytes]
"""The job's JSON as the API gives it; the API layer provides it (this package cannot import
the wire schema)."""


# --- signing -----------------------------------------------------------------------------------


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``X-Modelprep-Signature`` value for ``body`` sent at ``timestamp``."""
    digest = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify_signature(
    header: str,
    body: bytes,
    secret: bytes,
    *,
    tolerance: float = SIGNATURE_TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` and was made within ``tolerance``
    seconds of ``now``: what a receiver checks (the README shows the same in a few lines)."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        fields.setdefault(key, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    expected = sign(secret, timestamp, body).rsplit("v1=", 1)[1]
    return any(hmac.compare_digest(expected, given) for given in fields.get("v1", []))


def callback_secret(settings: Settings, tenant: str | None) -> bytes | None:
    """The key that signs ``tenant``'s callbacks (open mode: the service's), if configured."""
    secret = settings.callback_secret if tenant is None else settings.callback_secrets.get(tenant)
    return None if secret is None else secret.get_secret_value().encode()


def check_callback(spec: JobSpec, settings: Settings, tenant: str | None) -> None:
    """Submission-time checks of a job's callback: a key to sign it with exists, and its host,
    when a literal address, is one the egress policy allows (CallbackNotConfigured,
    EgressRefused)."""
    if spec.callback is None:
        return
    if callback_secret(settings, tenant) is None:
        who = "MODELPREP_CALLBACK_SECRET (open mode)" if tenant is None else (
            f"a key for tenant {tenant} in MODELPREP_CALLBACK_SECRETS"
        )
        raise CallbackNotConfigured(
            f"this service cannot sign callbacks for you: it needs {who}; ask its operator"
        )
    settings.egress_policy.check_literal(spec.callback.url)


def waiting_callback(spec: JobSpec) -> CallbackDelivery | None:
    """The delivery state a new job starts with."""
    if spec.callback is None:
        return None
    return CallbackDelivery(url=spec.callback.url, state=CallbackState.WAITING)


# --- delivery ----------------------------------------------------------------------------------


def backoff_seconds(settings: Settings, attempts: int, retry_after: float | None = None) -> float:
    """Delay after ``attempts`` failed attempts: doubling from ``callback_backoff_seconds``,
    at least the receiver's ``Retry-After``, at most ``callback_backoff_max_seconds``."""
    delay = Backoff(
        retries=settings.callback_max_attempts - 1,
        base_seconds=settings.callback_backoff_seconds,
        cap_seconds=settings.callback_backoff_max_seconds,
        failures=attempts,
    ).delay()  # the service's one schedule; the pause itself is a due time in the store
    if retry_after is not None:
        delay = max(delay, retry_after)
    return min(delay, settings.callback_backoff_max_seconds)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None or response.status_code not in (429, 503):
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - utcnow()).total_seconds())
    except (TypeError, ValueError):
        return None


def _resolve_or_retry(host: str, port: int) -> list[str]:
    """The system resolver, but a name that does not resolve (now) is a connection error, to
    be retried like a refused connection, not the egress refusal that fails a callback."""
    try:
        return system_resolver(host, port)
    except EgressRefused as exc:
        raise httpx.ConnectError(exc.message) from exc


class CallbackDeliverer:
    """Delivers due callbacks from the job store; see the module docstring.

    :meth:`deliver_due` is one pass (tests call it directly); :meth:`start` runs passes on a
    thread of its own until :meth:`stop`."""

    def __init__(self, settings: Settings, store: JobStore, render: RenderJob) -> None:
        self.settings = settings
        self.store = store
        self.render = render
        # One client for every attempt: building one (its TLS context) costs 0.15-0.3 s, more
        # than a POST; the egress transport still resolves and checks each request.
        policy = dataclasses.replace(settings.egress_policy, resolver=_resolve_or_retry)
        self._client = egress_client(policy, httpx.Timeout(settings.callback_timeout_seconds))
        self._pool = ThreadPoolExecutor(
            max_workers=settings.callback_concurrency, thread_name_prefix="modelprep-callback"
        )
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lease_seconds(self) -> float:
        """How long an attempt is held before another deliverer may take it: the POST's
        timeouts (connect, write, read) with a margin."""
        return 3 * self.settings.callback_timeout_seconds + 30

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="modelprep-callbacks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop looking for callbacks. Waits a few seconds for attempts in flight, not their
        whole timeout (a shutdown must be quick): one still unanswered is retried by another
        deliverer when its lease runs out, so the receiver may get it twice (at least once)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_GRACE_SECONDS)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is None or not self._thread.is_alive():
            self._client.close()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if self.deliver_due() >= BATCH:
                    continue  # a full batch: more may be due already (a burst of jobs ended)
            except Exception:  # a store hiccup must not end deliveries; the next pass retries
                log.exception("callback delivery pass failed")
            self._stopping.wait(self.settings.callback_poll_seconds)

    def deliver_due(self) -> int:
        """Deliver every callback due now (up to ``callback_concurrency`` at once); returns
        how many attempts were made."""
        now = utcnow()
        lease_until = now + timedelta(seconds=self.lease_seconds)
        jobs = []
        for job_id in self.store.due_callbacks(now, limit=BATCH):
            job = self.store.claim_callback(job_id, now, lease_until)
            if job is not None:
                jobs.append(job)
        for _ in self._pool.map(self.attempt, jobs):
            pass
        return len(jobs)

    def attempt(self, job: Job) -> CallbackState:
        """POST the claimed ``job`` to its callback URL once and record the outcome."""
        assert job.callback is not None
        if job.callback.attempts > self.settings.callback_max_attempts:
            # Claimed more often than allowed: earlier attempts never recorded an outcome (their
            # deliverer died mid-POST, again and again). Give up rather than loop forever.
            return self._record(job, None, "attempts used up without an answer recorded",
                                final=True)
        try:
            return self._post(job)
        except Exception as exc:  # a bug must cost one attempt, not the deliverer or the lease
            log.exception("callback attempt crashed", extra={"job_id": job.id})
            return self._record(job, None, f"internal error: {type(exc).__name__}")

    def _post(self, job: Job) -> CallbackState:
        assert job.callback is not None
        delivery = job.callback
        secret = callback_secret(self.settings, job.tenant)
        if secret is None:  # the key was removed from the settings since the job was accepted
            return self._record(job, None, CallbackNotConfigured.code + ": no key to sign with",
                                final=True)
        body = self.render(job)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "modelprep-callbacks/1",
            SIGNATURE_HEADER: sign(secret, int(time.time()), body),
            JOB_ID_HEADER: job.id,
            ATTEMPT_HEADER: str(delivery.attempts),
        }
        try:
            with self._client.stream(
                "POST", delivery.url, content=body, headers=headers
            ) as response:
                # The answer's body is not read: a receiver cannot make us hold much.
                if 200 <= response.status_code < 300:
                    return self._record(job, response.status_code, None, final=True,
                                        delivered=True)
                return self._record(
                    job, response.status_code, f"answered HTTP {response.status_code}",
                    retry_after=_retry_after(response),
                )
        except EgressRefused as exc:
            return self._record(job, None, f"{EgressRefused.code}: {exc.message}", final=True)
        except CertificateUntrusted as exc:  # the operator may yet trust its CA: retried
            return self._record(job, None, f"{CertificateUntrusted.code}: {exc.message}")
        except httpx.HTTPError as exc:
            return self._record(job, None, f"{type(exc).__name__}: {exc}"[:500])

    def _record(
        self,
        job: Job,
        status_code: int | None,
        error: str | None,
        *,
        final: bool = False,
        delivered: bool = False,
        retry_after: float | None = None,
    ) -> CallbackState:
        assert job.callback is not None
        attempts = job.callback.attempts
        next_at: datetime | None = None
        if delivered:
            state = CallbackState.DELIVERED
        elif final or attempts >= self.settings.callback_max_attempts:
            state = CallbackState.FAILED
        else:
            state = CallbackState.PENDING
            delay = backoff_seconds(self.settings, attempts, retry_after)
            next_at = utcnow() + timedelta(seconds=delay)
        recorded = self.store.record_callback(
            job.id, attempts, state, status_code=status_code, error=error, next_at=next_at
        )
        extra = {"job_id": job.id, "attempt": attempts, "callback_state": state.value,
                 "status_code": status_code}
        if not recorded:
            log.warning("callback attempt outlived its lease; its outcome is dropped",
                        extra=extra)
        elif state is CallbackState.DELIVERED:
            log.info("callback delivered", extra=extra)
        else:
            log.warning("callback attempt failed: %s", error, extra=extra)
        return state
