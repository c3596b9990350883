"""Web identity: a Kubernetes service account's token exchanged for temporary S3 keys.

A pod whose service account is bound to a role gets a token file (``AWS_WEB_IDENTITY_TOKEN_FILE``,
rotated by the kubelet) and a role (``AWS_ROLE_ARN``). :class:`WebIdentityCredentials` sends
STS ``AssumeRoleWithWebIdentity`` with botocore's STS client (unsigned: the request carries the
token) and keeps the answer, an access key, secret and session token, until its margin before
it expires (at least :data:`REFRESH_MARGIN`, and longer than a presigned URL lives); the token
file is read again at each refresh.

Why this cache and not botocore's own web identity provider, whose refreshable credentials
renew 15 minutes before expiry: a presigned download URL lives ``artifact_url_seconds`` (up to
7 days), and a URL dies with the keys that signed it, so the keys handed out must outlive it;
obstore's cache, too, must be told when to ask again (:meth:`WebIdentityCredentials.__call__`).
And the STS is the store's own by default (S3-compatible stores such as MinIO, Ceph RGW and
SeaweedFS serve STS on their S3 endpoint), where botocore's provider asks AWS's. One provider
per role and process serves obstore (``credential_provider``) and the requests botocore's S3
client makes (:meth:`WebIdentityCredentials.current`).

The STS endpoint: ``AWS_ENDPOINT_URL_STS``, else ``AWS_ENDPOINT_URL``, else the store's, else AWS
STS of the region; its request goes through the egress client. Errors: an STS that refuses the
token or the role is :class:`AccessDenied` naming the role; one that cannot be reached
(connection failures, 5xx, throttling) is retried with the download policy, then
:class:`SourceUnreachable`. Neither the token nor a key is ever logged or put in a message.
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

import httpx
from botocore.exceptions import BotoCoreError, ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError

from service.config import Settings
from service.egress import transport_failure
from service.errors import AccessDenied, SourceError, SourceUnreachable
from service.objectstore.aws import client_for, error_of
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

STS_READ_SECONDS = 30.0
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
        backoff = Backoff(self._settings.download_retries, self._settings.download_backoff_seconds)
        sts = client_for("sts", self._settings, self.endpoint, None, STS_READ_SECONDS)
        try:
            while True:
                try:
                    answer = sts.api.assume_role_with_web_identity(
                        RoleArn=self.role_arn, RoleSessionName=self._session_name,
                        WebIdentityToken=token,
                    )
                except ClientError as exc:
                    reason = self._refusal(exc, token)
                except (httpx.TransportError, BotoConnectionError, ResponseParserError) as exc:
                    reason = transport_failure(exc)
                except BotoCoreError as exc:  # a request botocore would not send
                    raise SourceError(
                        f"AssumeRoleWithWebIdentity for role {self.role_arn} was not sent: "
                        f"{type(exc).__name__}"
                    ) from None
                else:
                    credentials = self._keys(answer)
                    log.info("assumed role %s at %s until %s", self.role_arn, self.endpoint,
                             credentials.expires_at.isoformat())
                    return credentials
                if not backoff.failed():
                    raise SourceUnreachable(
                        f"the STS at {self.endpoint} ({self._settings.origin('s3_sts_endpoint')}) "
                        f"did not answer AssumeRoleWithWebIdentity for role {self.role_arn} "
                        f"after {backoff.failures} attempts ({reason})"
                    )
        finally:
            sts.close()

    def _refusal(self, exc: ClientError, token: str) -> str:
        """What another attempt may get past (5xx, throttling) as a reason to retry; anything
        else raised as the typed error it stands for."""
        status, code, message = error_of(exc)
        code = code or f"HTTP {status}"
        if (status or 0) >= 500 or status in (408, 429) or code in _TRANSIENT_CODES:
            return f"HTTP {status} {code}"
        detail = _JWT.sub("<token>", message.replace(token, "<token>"))[:300]
        if status in (400, 401, 403):
            raise AccessDenied(
                f"the STS at {self.endpoint} refused to let this service assume role "
                f"{self.role_arn} with its web identity token: {code}"
                + (f" ({detail})" if detail else "")
            ) from None
        raise SourceError(
            f"the STS at {self.endpoint} answered AssumeRoleWithWebIdentity with HTTP {status} "
            f"{code}"
        ) from None

    def _keys(self, answer: dict[str, object]) -> TemporaryCredentials:
        """The keys of STS's answer (botocore parsed it: ``Expiration`` is a datetime)."""
        found = answer.get("Credentials")
        values = found if isinstance(found, dict) else {}
        missing = [name for name in ("AccessKeyId", "SecretAccessKey", "SessionToken",
                                     "Expiration") if not values.get(name)]
        if missing:
            raise SourceError(f"the STS at {self.endpoint} answered without {missing}")
        expires = values["Expiration"]
        if not isinstance(expires, datetime):
            raise SourceError(f"the STS at {self.endpoint} answered an unreadable Expiration")
        # in UTC's own tzinfo: obstore refuses dateutil's tzutc, which botocore's parser gives
        expires = expires.replace(tzinfo=UTC) if expires.tzinfo is None else expires.astimezone(UTC)
        return TemporaryCredentials(str(values["AccessKeyId"]), str(values["SecretAccessKey"]),
                                    str(values["SessionToken"]), expires)


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
