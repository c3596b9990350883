"""botocore, the AWS SDK's core, for the requests obstore cannot make and the credential chain.

obstore (Rust ``object_store``) moves the bytes; it has no UploadPartCopy, ListMultipartUploads
or AbortMultipartUpload, and no STS client. Those go through botocore's own clients (its SigV4
signer, its S3 and STS models and XML parsers, its handling of an error document sent with a
200 answer), made here by :func:`client_for`, and botocore's session resolves the credential
chain the AWS SDKs share (:func:`sdk_credentials`: environment keys, the shared credentials and
config files of ``AWS_PROFILE`` with ``credential_process`` and assumed roles, container and
instance credentials).

Every request of such a client is sent by the service's egress client (botocore's
``before-send`` event: a handler that returns a response is used instead of botocore's own
sending), so the proxy and the store's CA bundle (``Settings.store_egress_policy``:
``MODELPREP_S3_CA_BUNDLE``, else ``AWS_CA_BUNDLE``, else the general one) apply to it as they
do to obstore's requests; a certificate it does not trust fails typed
(:class:`~service.errors.CertificateUntrusted`), naming those variables. STS requests are
judged by the egress policy each time, each connection going to the address it checked; the
store's endpoint, the operator's choice, is judged once per source (``check_egress``), as
obstore's requests are. botocore's own retries are
off: :func:`service.objectstore.errors.call` retries with the one download policy
(service/retry.py). Checksums are computed only where an operation requires one (S3-compatible
stores refuse the trailing checksums botocore now adds by default).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import botocore.session
import httpx
from botocore import UNSIGNED
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.config import Config
from botocore.credentials import EnvProvider
from botocore.exceptions import BotoCoreError

from service.config import Settings
from service.egress import egress_client

if TYPE_CHECKING:
    from botocore.client import BaseClient
    from botocore.credentials import Credentials


@dataclass(frozen=True)
class StaticCredentials:
    """A key pair (and session token) this process holds itself: what signs a request now."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


_SDK_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_EC2_METADATA_DISABLED",
)
"""The variables botocore's chain reads itself (the profile and its files come from the
settings); credentials are resolved again when one of them changes."""

_lock = threading.Lock()
_sessions: dict[tuple[object, ...], botocore.session.Session] = {}
_credentials: dict[tuple[object, ...], Credentials] = {}


def _session_key(settings: Settings) -> tuple[object, ...]:
    return (settings.aws_profile, settings.aws_config_file, settings.aws_shared_credentials_file)


def _session(settings: Settings) -> botocore.session.Session:
    """One botocore session per process and profile, with the profile and files of the
    settings (``AWS_PROFILE``, ``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``); its
    loaded service models are shared by every client made from it. Call with ``_lock``."""
    key = _session_key(settings)
    if key not in _sessions:
        session = botocore.session.Session()
        for name, value in (("profile", settings.aws_profile),
                            ("config_file", settings.aws_config_file),
                            ("credentials_file", settings.aws_shared_credentials_file)):
            if value is not None:
                session.set_config_variable(name, str(value))
        _sessions[key] = session
    return _sessions[key]


def sdk_credentials(settings: Settings) -> Credentials | None:
    """The credentials of the AWS SDKs' chain (environment keys, the profile's files,
    container and instance credentials), or None when no source has any (asked again next
    time: an instance's metadata service may have been slow). Found ones are kept per process
    and environment; temporary ones renew themselves (``get_frozen_credentials``)."""
    key = (*_session_key(settings), *(os.environ.get(name) for name in _SDK_ENVIRONMENT))
    with _lock:
        found = _credentials.get(key)
        if found is None:
            # Environment keys first, as the chain's first step: botocore drops that step
            # when a profile is given to the session, as the settings' AWS_PROFILE is.
            found = EnvProvider().load() or _session(settings).get_component(
                "credential_provider").load_credentials()
            if found is not None:
                _credentials[key] = found
        return found


_LOCAL_METHODS = ("shared-credentials-file", "config-file")
"""The chain's steps that only read a file: what :func:`local_source` may ask (the others call
STS, run a process or ask the network)."""


def local_source(settings: Settings) -> str | None:
    """The step of the SDK chain past the environment that holds keys in a file now
    (``shared-credentials-file``, ``config-file``), or None; no network, no key returned."""
    with _lock:
        resolver = _session(settings).get_component("credential_provider")
    for provider in resolver.providers:
        if provider.METHOD not in _LOCAL_METHODS:
            continue
        try:
            found = provider.load()
        except BotoCoreError:  # a file it cannot read (or a missing profile) holds no keys
            found = None
        if found is not None:
            return str(provider.METHOD)
    return None


class _Body:
    """The ``raw`` of an :class:`AWSResponse`: botocore reads it through ``stream()``."""

    def __init__(self, content: bytes) -> None:
        self._content = content

    def stream(self, **_: object) -> Iterator[bytes]:
        yield self._content


class _EgressSend:
    """botocore's ``before-send`` handler: sends the signed request with the service's egress
    client (policy, proxy, the store's CA bundle) and hands botocore the answer."""

    def __init__(self, settings: Settings, read_seconds: float, judged: bool) -> None:
        self._http = egress_client(settings.store_egress_policy,
                                   httpx.Timeout(read_seconds, connect=10.0), judged)

    def __call__(self, request: AWSPreparedRequest, **_: object) -> AWSResponse:
        body = request.body
        if hasattr(body, "read"):
            body = body.read()
        response = self._http.request(
            request.method, request.url, headers=dict(request.headers.items()),
            content=body.encode() if isinstance(body, str) else body,
        )
        return AWSResponse(request.url, response.status_code, response.headers,
                           _Body(response.content))

    def close(self) -> None:
        self._http.close()


class AwsClient:
    """A botocore client (:attr:`api`) whose requests go through the egress client."""

    def __init__(self, api: BaseClient, send: _EgressSend) -> None:
        self.api = api
        self._send = send

    def close(self) -> None:
        """Close its connections."""
        self._send.close()
        self.api.close()


def client_for(
    service: Literal["s3", "sts"], settings: Settings, endpoint: str,
    keys: StaticCredentials | None, read_seconds: float,
) -> AwsClient:
    """A botocore client of ``service`` at ``endpoint`` signing with ``keys`` (None: unsigned,
    for STS AssumeRoleWithWebIdentity, which carries its own token), whose requests go through
    the egress client. Path-style addressing, as S3-compatible stores serve it."""
    config = Config(
        region_name=settings.s3_region, retries={"total_max_attempts": 1},
        connect_timeout=10, read_timeout=read_seconds, s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        signature_version=UNSIGNED if keys is None else None,
    )
    credentials: dict[str, Any] = {} if keys is None else {
        "aws_access_key_id": keys.access_key_id,
        "aws_secret_access_key": keys.secret_access_key,
        "aws_session_token": keys.session_token,
    }
    with _lock:
        api = _session(settings).create_client(
            service, endpoint_url=endpoint, config=config, **credentials
        )
    # STS is judged by the egress policy at each request; the store's endpoint once per
    # source (check_egress), as obstore's own requests are
    send = _EgressSend(settings, read_seconds, judged=service == "sts")
    api.meta.events.register_first(f"before-send.{service}", send)
    return AwsClient(api, send)


def error_of(exc: BaseException) -> tuple[int | None, str, str]:
    """(HTTP status, error code, message) of a botocore ``ClientError``; (None, "", "") for
    another exception."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, "", ""
    error = response.get("Error") or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (int(status) if status is not None else None, str(error.get("Code") or ""),
            str(error.get("Message") or ""))
