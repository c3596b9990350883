"""Web identity: a Kubernetes service account's token exchanged for temporary S3 keys.

A pod whose service account is bound to a role gets a token file (``AWS_WEB_IDENTITY_TOKEN_FILE``,
rotated by the kubelet) and a role (``AWS_ROLE_ARN``). :class:`WebIdentityCredentials` sends
STS ``AssumeRoleWithWebIdentity`` (the query API: a form POST that carries the token and needs no
signature) and keeps the answer, an access key, secret and session token, until
its margin before it expires (at least :data:`REFRESH_MARGIN`, and longer than a presigned
URL lives); the token file is read again at each refresh.

Why here and not object_store's own chain: object_store asks only AWS's STS (S3-compatible stores
such as MinIO, Ceph RGW and SeaweedFS serve STS on their S3 endpoint), its requests bypass the
egress policy, and the keys it gets stay inside it, so the requests this service signs itself
(``service.objectstore.multipart``: UploadPartCopy, ListMultipartUploads, AbortMultipartUpload)
could not use them. One provider per role and process serves both: obstore through its
``credential_provider`` callback (:meth:`WebIdentityCredentials.__call__`), the signed requests
through :meth:`WebIdentityCredentials.current`.

The STS endpoint: ``AWS_ENDPOINT_URL_STS``, else the store's (``MODELPREP_S3_ENDPOINT``), else
AWS STS of the region. Errors: an STS that refuses the token or the role is
:class:`AccessDenied` naming the role; one that cannot be reached (connection failures, 5xx,
throttling) is retried with the download policy, then :class:`SourceUnreachable`. Neither the
token nor a key is ever logged or put in a message.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from xml.etree import ElementTree

import httpx

from service.config import Settings
from service.egress import egress_client
from service.errors import AccessDenied, SourceError, SourceUnreachable
from service.retry import Backoff

if TYPE_CHECKING:
    from obstore.store import S3Credential

log = logging.getLogger(__name__)

REFRESH_MARGIN = timedelta(minutes=10)
"""Keys are renewed this long before they expire: longer than the 5 minutes before expiry at
which obstore's own cache asks again, so obstore never gets keys it would at once ask again for,
and a request signed just before the refresh still has minutes to be sent."""

OBSTORE_EARLY = timedelta(minutes=5)
"""obstore's cache asks its ``credential_provider`` again this long before the expiry it was
given (:meth:`WebIdentityCredentials.__call__` moves that expiry so it asks when we would)."""

URL_SLACK = timedelta(minutes=1)
"""Beyond a presigned URL's lifetime, what the keys that sign it must still have left."""

STS_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
_JWT = re.compile(r"[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
_TRANSIENT_CODES = ("IDPCommunicationError", "Throttling", "ServiceUnavailable", "InternalError")
"""STS error codes another attempt may get past (AWS SDKs retry these too)."""


@dataclass(frozen=True)
class TemporaryCredentials:
    """Keys valid until ``expires_at``; every request signed with them carries
    ``session_token`` (``X-Amz-Security-Token``)."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str = field(repr=False)
    expires_at: datetime


def web_identity_configured(settings: Settings) -> bool:
    """True when both the token file and the role are set (one alone is ignored, as the AWS
    SDKs do)."""
    return settings.s3_web_identity_token_file is not None and bool(settings.s3_role_arn)


def sts_endpoint_of(settings: Settings) -> str:
    """Where AssumeRoleWithWebIdentity goes: ``AWS_ENDPOINT_URL_STS``, else the S3 endpoint
    (an S3-compatible store serves STS there), else AWS STS of the region."""
    endpoint = settings.s3_sts_endpoint or settings.s3_endpoint
    if endpoint:
        return endpoint.rstrip("/")
    return f"https://sts.{settings.s3_region}.amazonaws.com"


def _local(root: ElementTree.Element, name: str) -> str | None:
    """The text of the first element named ``name`` in any namespace."""
    for element in root.iter():
        if element.tag.rpartition("}")[2] == name and element.text:
            return element.text.strip()
    return None


class WebIdentityCredentials:
    """Temporary keys of one role, obtained with the token in one file and renewed before they
    expire. Thread-safe: concurrent callers wait for one STS request."""

    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if not web_identity_configured(settings):
            raise AccessDenied("web identity needs AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN")
        assert settings.s3_web_identity_token_file is not None and settings.s3_role_arn
        self.token_file: Path = settings.s3_web_identity_token_file
        self.role_arn: str = settings.s3_role_arn
        self.endpoint = sts_endpoint_of(settings)
        self._session_name = settings.s3_role_session_name
        self._settings = settings
        self._clock = clock or (lambda: datetime.now(UTC))
        self._lock = threading.Lock()
        self._cached: TemporaryCredentials | None = None
        self._cached_margin = REFRESH_MARGIN
        self.margin = max(
            REFRESH_MARGIN, timedelta(seconds=settings.artifact_url_seconds) + URL_SLACK
        )
        """How long the keys handed out stay valid at least: a presigned URL (valid
        ``artifact_url_seconds``) signed with them must not outlive them, so the margin is that
        lifetime plus :data:`URL_SLACK` when it is longer than :data:`REFRESH_MARGIN`."""

    def _margin_for(self, found: TemporaryCredentials, issued: datetime) -> timedelta:
        """:attr:`margin`, at most half of what STS granted: a role whose sessions are shorter
        than the URL lifetime would otherwise cost an STS request per call (its URLs are then
        shortened by :meth:`url_seconds`)."""
        return min(self.margin, (found.expires_at - issued) / 2)

    def current(self) -> TemporaryCredentials:
        """Keys valid for at least the margin more (asked of STS when the cached ones are not)."""
        with self._lock:
            cached, now = self._cached, self._clock()
            if cached is None or cached.expires_at - now <= self._cached_margin:
                cached = self._cached = self._assume_role()
                self._cached_margin = self._margin_for(cached, now)
            return cached

    def url_seconds(self, wanted: int) -> int:
        """The lifetime of a URL presigned now with :meth:`current`'s keys: ``wanted``, or less
        when the keys expire sooner (a URL is refused once its keys have expired, whatever its
        own expiry says)."""
        left = self.current().expires_at - self._clock() - URL_SLACK
        return max(1, min(wanted, int(left.total_seconds())))

    def __call__(self) -> S3Credential:
        """obstore's ``credential_provider`` callback (a typed error raised here reaches the
        caller as obstore's UnauthenticatedError naming it: ``service.objectstore.classify``).

        The expiry handed to obstore is moved earlier so that obstore, which asks again
        :data:`OBSTORE_EARLY` before it, asks when the keys have the margin left: otherwise it
        would sign presigned URLs with keys that have only minutes to live."""
        found = self.current()
        return {
            "access_key_id": found.access_key_id,
            "secret_access_key": found.secret_access_key,
            "token": found.session_token,
            "expires_at": found.expires_at - self._cached_margin + OBSTORE_EARLY,
        }

    def _read_token(self) -> str:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise AccessDenied(
                f"cannot read the web identity token file {self.token_file} "
                f"({exc.strerror or type(exc).__name__}) to assume role {self.role_arn}"
            ) from None
        if not token:
            raise AccessDenied(f"the web identity token file {self.token_file} is empty")
        return token

    def _assume_role(self) -> TemporaryCredentials:
        token = self._read_token()  # each refresh: the kubelet rewrites it before it expires
        form = {
            "Action": "AssumeRoleWithWebIdentity",
            "Version": "2011-06-15",
            "RoleArn": self.role_arn,
            "RoleSessionName": self._session_name,
            "WebIdentityToken": token,
        }
        backoff = Backoff(self._settings.download_retries, self._settings.download_backoff_seconds)
        with egress_client(self._settings.egress_policy, STS_TIMEOUT) as client:
            while True:
                try:
                    response = client.post(
                        self.endpoint + "/", data=form, headers={"accept": "application/xml"}
                    )
                    credentials = self._answer(response, token)
                except _Transient as exc:
                    reason = str(exc)
                except httpx.TransportError as exc:
                    reason = type(exc).__name__
                else:
                    log.info(
                        "assumed role %s at %s until %s",
                        self.role_arn,
                        self.endpoint,
                        credentials.expires_at.isoformat(),
                    )
                    return credentials
                if not backoff.failed():
                    raise SourceUnreachable(
                        f"the STS at {self.endpoint} did not answer AssumeRoleWithWebIdentity "
                        f"for role {self.role_arn} after {backoff.failures} attempts ({reason})"
                    )

    def _answer(self, response: httpx.Response, token: str) -> TemporaryCredentials:
        """The keys in STS's answer, or the typed error it stands for."""
        try:
            root: ElementTree.Element | None = ElementTree.fromstring(response.content)
        except ElementTree.ParseError:
            root = None
        status = response.status_code
        if response.is_success and root is not None:
            values = {
                name: _local(root, name)
                for name in ("AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration")
            }
            missing = [name for name, value in values.items() if not value]
            if missing:
                raise SourceError(f"the STS at {self.endpoint} answered without {missing}")
            try:
                expires = datetime.fromisoformat(str(values["Expiration"]))
            except ValueError:
                raise SourceError(
                    f"the STS at {self.endpoint} answered an unreadable Expiration"
                ) from None
            if expires.tzinfo is None:
                expires = expires.replace(tzinfo=UTC)
            return TemporaryCredentials(
                str(values["AccessKeyId"]),
                str(values["SecretAccessKey"]),
                str(values["SessionToken"]),
                expires,
            )
        code = (_local(root, "Code") if root is not None else None) or f"HTTP {status}"
        if status >= 500 or status in (408, 429) or code in _TRANSIENT_CODES:
            raise _Transient(f"HTTP {status} {code}")
        detail = (_local(root, "Message") if root is not None else None) or ""
        detail = _JWT.sub("<token>", detail.replace(token, "<token>"))[:300]
        if status in (400, 401, 403):
            raise AccessDenied(
                f"the STS at {self.endpoint} refused to let this service assume role "
                f"{self.role_arn} with its web identity token: {code}"
                + (f" ({detail})" if detail else "")
            )
        raise SourceError(
            f"the STS at {self.endpoint} answered AssumeRoleWithWebIdentity with HTTP {status} "
            f"{code}"
        )


class _Transient(Exception):
    """An answer another attempt may get past (5xx, throttling)."""


_providers: dict[tuple[object, ...], WebIdentityCredentials] = {}
_providers_lock = threading.Lock()


def web_identity_for(settings: Settings) -> WebIdentityCredentials:
    """The process's provider for the role of ``settings``: one per role, token file and STS,
    so every client and signed request of the process shares its cached keys (a client made per
    job would otherwise ask STS per job)."""
    key = (
        settings.s3_role_arn,
        settings.s3_web_identity_token_file,
        sts_endpoint_of(settings),
        settings.s3_role_session_name,
        tuple(settings.egress_allowlist),
        settings.download_retries,
        settings.download_backoff_seconds,
    )
    with _providers_lock:
        found = _providers.get(key)
        if found is None:
            found = _providers[key] = WebIdentityCredentials(settings)
        return found
