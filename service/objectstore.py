"""S3-compatible object storage: locations, clients, credentials and typed errors.

One module for everything that talks to a bucket, used by ``s3://`` sources and by the
artifact store. The client is ``obstore`` (Rust ``object_store``): on this project's test server
it reads about 2x and writes about 1.4x faster than boto3, its only dependency is
``typing-extensions`` (botocore pins ``python-dateutil<3``, which the rest of the stack has
moved past), and it streams both ways without holding an object in memory.

Credentials, in order (read when a client is made, never at import):

1. the tenant's pair in ``MODELPREP_S3_CREDENTIALS`` (``{"tenant": {"access_key_id",
   "secret_access_key"}}``), so each tenant reaches only what its own key may;
2. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``;
3. web identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``: Kubernetes service
   accounts), exchanged for temporary keys by this service (service/web_identity.py: its STS
   request obeys the egress policy, goes to the store's own STS, and the keys also sign the
   requests obstore cannot make), handed to obstore as its ``credential_provider``;
4. the rest of the chain ``object_store`` implements (ECS container credentials, the instance
   metadata service);
5. the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``, default
   ``~/.aws/credentials``, profile ``AWS_PROFILE`` or ``default``), which ``object_store`` does
   not read itself, used when the environment names neither keys nor a web identity.

A job's request never carries a key: ``s3://`` URIs with user info are refused. Keys are not
logged nor put in error messages (obstore's messages name the URL and status, never headers).

Error mapping (:func:`classify`): a missing bucket or key is :class:`ObjectNotFound`, a refused
signature, unknown key or missing permission :class:`AccessDenied`, bytes that do not match
the checksum sent with them (``BadDigest``) :class:`ChecksumMismatch`, a connection failure a
transient error that is retried and then :class:`SourceUnreachable`. ``obstore`` raises typed
exceptions for object requests (NotFoundError, PermissionDeniedError, UnauthenticatedError)
but a bare ``GenericError`` for listings; for those the HTTP status and S3 error code in its
message are read (tests/unit/test_objectstore.py pins that assumption).

Why one module of over 450 lines: every request to a bucket shares the credential chain, the
egress check and :func:`classify`'s error mapping above, and that is one contract with S3.
About a third of it is the server-side copy of objects over CopyObject's 5 GB limit
(:class:`MultipartCopy`): obstore has no UploadPartCopy, so those requests are signed here
(:func:`sigv4_headers`) with the same credentials :func:`store_for` uses, which keeps them
beside it. If that part grows, it is the piece to move into a module of its own.
"""

from __future__ import annotations

import configparser
import contextlib
import errno
import hashlib
import hmac
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

import httpx
import obstore
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store

from service.config import Settings
from service.errors import (
    AccessDenied,
    ChecksumMismatch,
    DiskFull,
    InvalidRequest,
    ObjectNotFound,
    ServiceError,
    SourceError,
    SourceUnreachable,
)
from service.retry import Backoff
from service.web_identity import web_identity_configured, web_identity_for

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

    from service.web_identity import WebIdentityCredentials

T = TypeVar("T")

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SEGMENT = re.compile(r"^[A-Za-z0-9!_.*'()+=@,;:$&-][A-Za-z0-9!_.*'()+=@,;:$& -]{0,254}$")
_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_NOT_FOUND_CODES = ("NoSuchBucket", "NoSuchKey", "NotFound")
_DENIED_CODES = (
    "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken",
    "ExpiredToken", "AllAccessDisabled",
)  # fmt: skip


_DIGEST_CODES = ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest")
"""What a server answers a part whose bytes do not match the checksum sent with it."""


@dataclass(frozen=True)
class S3Location:
    """``s3://<bucket>/<prefix>``: a bucket and a key prefix of ``/``-separated segments, none
    of them empty, ``.`` or ``..`` (so a location can never name a key outside its prefix)."""

    bucket: str
    prefix: str
    """No leading or trailing ``/``; empty for the whole bucket."""

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        """Parse and validate; raises InvalidRequest (user info is refused: a key in a URI
        would be stored with the job)."""
        parts = urlsplit(uri)
        if parts.scheme != "s3":
            raise InvalidRequest(f"not an s3:// URI: {uri!r}")
        if "@" in parts.netloc or parts.query or parts.fragment:
            raise InvalidRequest("an s3:// URI takes no credentials, query or fragment")
        bucket = parts.netloc
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise InvalidRequest(f"malformed bucket name {bucket!r}")
        prefix = parts.path.removeprefix("/").removesuffix("/")
        if prefix:
            for segment in prefix.split("/"):
                if segment in (".", "..") or not _SEGMENT.match(segment):
                    raise InvalidRequest(
                        f"s3 key prefix {prefix!r} has an empty, '.', '..' or unusual segment"
                    )
        return cls(bucket, prefix)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, *names: str) -> str:
        """The key of ``names`` under the prefix; each name is one or more plain segments."""
        for name in names:
            for segment in name.split("/"):
                if segment in ("", ".", "..") or not _SEGMENT.match(segment):
                    raise InvalidRequest(f"refused object name {name!r}")
        return "/".join(p for p in (self.prefix, *names) if p)

    def child(self, *names: str) -> S3Location:
        return S3Location(self.bucket, self.key(*names))

    def parent(self) -> S3Location:
        return S3Location(self.bucket, self.prefix.rpartition("/")[0])

    @property
    def name(self) -> str:
        """The last segment of the prefix (an object's file name)."""
        return self.prefix.rpartition("/")[2]

    def within(self, other: S3Location) -> bool:
        """True when this location is ``other`` or under it, segment-wise (``a/bc`` is not
        under ``a/b``)."""
        if self.bucket != other.bucket:
            return False
        return not other.prefix or self.prefix == other.prefix \
            or self.prefix.startswith(other.prefix + "/")


def endpoint_of(settings: Settings) -> str:
    """The endpoint URL requests go to (AWS S3 of the region when none is configured)."""
    if settings.s3_endpoint:
        return settings.s3_endpoint.rstrip("/")
    return f"https://s3.{settings.s3_region}.amazonaws.com"


def check_egress(settings: Settings) -> None:
    """The egress policy applied to the endpoint: it must resolve to an address the policy
    allows. ``object_store`` connects by itself, so the address is checked, not pinned."""
    parts = urlsplit(endpoint_of(settings))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    settings.egress_policy.resolve(parts.hostname or "", port)


def _shared_file_credentials() -> S3Config | None:
    """Keys of the shared credentials file's profile, when the environment names no other
    source of credentials (the chain's order: environment and web identity first)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE") \
            or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") \
            or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return None
    path = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    if not path.is_file():
        return None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except configparser.Error:
        return None
    profile = env.get("AWS_PROFILE") or "default"
    if not parser.has_section(profile):
        return None
    section = parser[profile]
    key, secret = section.get("aws_access_key_id"), section.get("aws_secret_access_key")
    if not key or not secret:
        return None
    found: S3Config = {"access_key_id": key, "secret_access_key": secret}
    if section.get("aws_session_token"):
        found["session_token"] = section["aws_session_token"]
    return found


def public_endpoint_of(settings: Settings) -> str:
    """The endpoint presigned URLs name: where clients outside the service's network reach the
    store (``s3_public_endpoint``), else the one the service uses."""
    if settings.s3_public_endpoint:
        return settings.s3_public_endpoint.rstrip("/")
    return endpoint_of(settings)


def stall_read_seconds(settings: Settings) -> float:
    """How long one object-store request may wait for the server's next bytes: the stall bound
    of every transfer (``download_stall_seconds``), at most 60 s. obstore's requests and the
    signed ones of :class:`MultipartUploads` use the same figure, so a store that stopped
    answering fails each of them as soon as it fails a download."""
    return min(60.0, settings.download_stall_seconds)


def store_for(
    bucket: str, settings: Settings, tenant: str | None, *, checksum: bool = False,
    endpoint: str | None = None,
) -> S3Store:
    """A client of ``bucket`` with the tenant's credentials, else the standard chain.

    ``checksum``: every upload (each part of a multipart one) carries its SHA-256, which the
    server checks against the bytes it received. ``endpoint``: another address of the same
    store (presigning for clients elsewhere); default :func:`endpoint_of`."""
    endpoint = endpoint or endpoint_of(settings)
    config: S3Config = {"region": settings.s3_region, "endpoint": endpoint}
    if checksum:
        config["checksum_algorithm"] = "sha256"
    entry = settings.s3_credentials.get(tenant) if tenant is not None else None
    provider: WebIdentityCredentials | None = None
    if entry is not None:
        config["access_key_id"] = entry.access_key_id
        config["secret_access_key"] = entry.secret_access_key.get_secret_value()
        if entry.session_token is not None:
            config["session_token"] = entry.session_token.get_secret_value()
    elif _uses_web_identity(settings):
        provider = web_identity_for(settings)
        provider.current()  # STS refusing or unreachable fails here, typed, before any request
    else:
        config.update(_shared_file_credentials() or {})
    client: ClientConfig = {
        "allow_http": endpoint.startswith("http://"),
        "connect_timeout": timedelta(seconds=10),
        "read_timeout": timedelta(seconds=stall_read_seconds(settings)),
    }
    # Retries are the caller's (:func:`call`, the source's resumable reads): one policy,
    # service/retry.py, for every transfer.
    retry: RetryConfig = {"max_retries": 0}
    return S3Store(bucket, config=config, client_options=client, retry_config=retry,
                   credential_provider=provider)


def presign_seconds(settings: Settings, tenant: str | None, wanted: int) -> int:
    """How long a URL presigned now for ``tenant`` may be valid: ``wanted``, unless it is
    signed with web identity's temporary keys that expire sooner (a URL dies with its keys)."""
    own = settings.s3_credentials.get(tenant) if tenant is not None else None
    if own is None and _uses_web_identity(settings):
        return web_identity_for(settings).url_seconds(wanted)
    return wanted


def _uses_web_identity(settings: Settings) -> bool:
    """Web identity is the chain's choice: configured, and no key pair in the environment
    (which comes first, as in the AWS SDKs)."""
    return web_identity_configured(settings) and not os.environ.get("AWS_ACCESS_KEY_ID")


def _status(message: str) -> int | None:
    match = _STATUS.search(message)
    return int(match.group(1)) if match else None


_PROVIDER_FAILED = "External AWS credential provider: "
_PROVIDER_ERROR = re.compile(re.escape(_PROVIDER_FAILED) + r"(\w+): ([^\n]*)")


def _provider_failure(message: str, what: str) -> ServiceError:
    """The typed error of a ``credential_provider`` callback that raised: obstore reports it as
    UnauthenticatedError ``External AWS credential provider: <class>: <message>`` (the
    callback is :class:`~service.web_identity.WebIdentityCredentials`, whose messages hold
    neither token nor key). An STS that could not be reached stays SourceUnreachable."""
    match = _PROVIDER_ERROR.search(message)
    name, detail = (match.group(1), match.group(2)) if match else ("", message.splitlines()[0])
    if name == SourceUnreachable.__name__:
        return SourceUnreachable(f"{what}: {detail}")
    return AccessDenied(f"no credentials for {what}: {detail}")


def classify(exc: BaseException, what: str) -> ServiceError | None:
    """The typed error for an object-store failure about ``what`` (a location, never a key
    pair), or None when another attempt may succeed (connection failures, 5xx, throttling)."""
    if isinstance(exc, ServiceError):
        return exc
    # obstore raises the builtin FileNotFoundError (no errno) for a missing object; one from
    # the local filesystem carries ENOENT and is not the store's.
    if isinstance(exc, NotFoundError) or (isinstance(exc, FileNotFoundError)
                                         and exc.errno is None):
        return ObjectNotFound(f"{what} not found in the object store")
    if isinstance(exc, UnauthenticatedError) and _PROVIDER_FAILED in str(exc):
        return _provider_failure(str(exc), what)
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return AccessDenied(f"the object store refused access to {what}")
    if isinstance(exc, PreconditionError):
        return ChecksumMismatch(f"{what} changed while it was being read")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DiskFull(f"disk full while transferring {what}")
    if isinstance(exc, BaseError):
        message = str(exc)
        status = _status(message)
        if status == 404 or any(code in message for code in _NOT_FOUND_CODES):
            return ObjectNotFound(f"{what} not found in the object store")
        if status in (401, 403) or any(code in message for code in _DENIED_CODES):
            return AccessDenied(f"the object store refused access to {what} (HTTP {status})")
        if any(f"<Code>{code}</Code>" in message for code in _DIGEST_CODES):
            return ChecksumMismatch(
                f"the object store refused {what}: the bytes it received do not match the "
                "checksum sent with them"
            )
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            return SourceError(f"the object store answered HTTP {status} for {what}")
        return None
    if isinstance(exc, ValueError):  # obstore's path parsing
        return InvalidRequest(f"refused object path for {what}")
    return None


def call(fn: Callable[[], T], what: str, settings: Settings) -> T:
    """Run one object-store call, retrying transient failures with backoff; every failure
    ends as a typed error (:class:`SourceUnreachable` once retries are exhausted)."""
    backoff = Backoff(settings.download_retries, settings.download_backoff_seconds)
    while True:
        try:
            return fn()
        except Exception as exc:  # every failure is classified below, none is swallowed
            mapped = classify(exc, what)
            if mapped is not None:
                if mapped is exc:
                    raise
                raise mapped from exc
            if not backoff.failed():
                raise SourceUnreachable(
                    f"the object store at {endpoint_of(settings)} did not answer for {what} "
                    f"after {backoff.failures} attempts"
                ) from exc


def list_dir(store: S3Store, location: S3Location, settings: Settings) -> list[obstore.ObjectMeta]:
    """The objects directly under ``location`` (``prefix/name``, no deeper), by key."""
    result = call(lambda: obstore.list_with_delimiter(store, location.prefix or None),
                  location.uri, settings)
    return sorted(result["objects"], key=lambda meta: meta["path"])


# --- multipart copy ----------------------------------------------------------------------------
#
# S3's CopyObject copies at most 5 GB; a larger object is copied with a multipart upload whose
# parts are UploadPartCopy requests (``x-amz-copy-source`` + ``x-amz-copy-source-range``), each
# copying a range server-side. ``obstore.copy`` (object_store 0.12) sends CopyObject only and
# offers no multipart primitives, so these four requests are signed here (AWS SigV4, header
# form) and sent with httpx. SeaweedFS implements UploadPartCopy (``CopyObjectPartHandler``,
# ranges of the source's chunks copied between volume servers); MinIO, Ceph RGW and AWS too.

COPY_OBJECT_MAX_BYTES = 5 * 1000**3
"""S3's CopyObject limit (5 GB); a larger source is copied part by part."""
COPY_PART_BYTES = 1024**3
"""UploadPartCopy range size: within S3's 5 MiB..5 GiB, 10,000 parts cover 10 TiB."""
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class StaticCredentials:
    """A key pair (and session token) this process holds itself, to sign requests obstore
    cannot make."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def static_credentials(settings: Settings, tenant: str | None) -> StaticCredentials:
    """The keys :func:`store_for` would use, now: the tenant's, the environment's, web
    identity's temporary ones (with their session token; valid for minutes at least, so ask
    again for each request), or the shared file's. Container and instance credentials are
    resolved inside object_store, out of reach: copying a > 5 GB object then fails typed
    (:class:`AccessDenied`, naming the reason), never by moving the bytes through here."""
    entry = settings.s3_credentials.get(tenant) if tenant is not None else None
    if entry is not None:
        return StaticCredentials(
            entry.access_key_id, entry.secret_access_key.get_secret_value(),
            entry.session_token.get_secret_value() if entry.session_token else None,
        )
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return StaticCredentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                 env.get("AWS_SESSION_TOKEN") or None)
    if _uses_web_identity(settings):
        found = web_identity_for(settings).current()
        return StaticCredentials(found.access_key_id, found.secret_access_key,
                                 found.session_token)
    shared = _shared_file_credentials()
    if shared is not None:
        return StaticCredentials(shared["access_key_id"], shared["secret_access_key"],
                                 shared.get("session_token"))
    raise AccessDenied(
        "copying an object larger than 5 GB needs a key pair (tenant, AWS_* environment, web "
        "identity or shared credentials file); instance credentials cannot sign it here"
    )


def _quote_key(key: str) -> str:
    return "/".join(quote(segment, safe="-_.~") for segment in key.split("/"))


def _canonical_query(query: dict[str, str]) -> str:
    return "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
    )


def sigv4_headers(
    method: str, url: str, query: dict[str, str], headers: dict[str, str], payload: bytes,
    credentials: StaticCredentials, region: str, now: datetime | None = None,
) -> dict[str, str]:
    """``headers`` plus the SigV4 ``Authorization``, ``x-amz-date`` and
    ``x-amz-content-sha256`` of one S3 request (``url`` without its query, path already
    quoted as sent)."""
    parts = urlsplit(url)
    now = now or datetime.now(UTC)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(payload).hexdigest() if payload else _EMPTY_SHA256
    signed = {k.lower(): v.strip() for k, v in headers.items()}
    signed.update({"host": parts.netloc, "x-amz-date": amz_date,
                   "x-amz-content-sha256": payload_hash})
    if credentials.session_token:
        signed["x-amz-security-token"] = credentials.session_token
    names = sorted(signed)
    canonical = "\n".join([
        method, parts.path or "/", _canonical_query(query),
        *(f"{n}:{signed[n]}" for n in names), "", ";".join(names), payload_hash,
    ])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + credentials.secret_access_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out = {k: v for k, v in signed.items() if k != "host"}
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={credentials.access_key_id}/{scope}, "
                            f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return out


class _Transient(Exception):
    """A 5xx, throttling or a dropped connection: :func:`call` tries again."""


def _s3_error_code(body: bytes) -> str | None:
    """The ``<Code>`` of an S3 error document, None when ``body`` is not one (S3 may answer a
    copy with 200 and an error document: the status alone is not the outcome)."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        return None
    if root.tag.rpartition("}")[2] != "Error":
        return None
    return root.findtext("Code") or "Error"


def _element(body: bytes, name: str) -> str:
    root = ElementTree.fromstring(body)
    for element in root.iter():
        if element.tag.rpartition("}")[2] == name and element.text:
            return element.text
    raise SourceError(f"the object store's answer has no {name}")


class _SignedRequests:
    """S3 requests obstore cannot make, signed here with the keys of :func:`static_credentials`
    and sent with httpx; each through :func:`call` (retries, typed errors) unless ``retry`` is
    off."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None,
                 read_seconds: float) -> None:
        self._bucket = bucket
        self._settings = settings
        self._tenant = tenant
        static_credentials(settings, tenant)  # none to sign with: fail now, typed
        self._http = httpx.Client(timeout=httpx.Timeout(read_seconds, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def _request(
        self, method: str, key: str, query: dict[str, str], headers: dict[str, str] | None = None,
        payload: bytes = b"", retry: bool = True,
    ) -> httpx.Response:
        url = f"{endpoint_of(self._settings)}/{self._bucket}/{_quote_key(key)}"
        what = f"s3://{self._bucket}/{key}"

        def send() -> httpx.Response:
            # asked for each request: temporary keys are renewed during a long copy
            credentials = static_credentials(self._settings, self._tenant)
            signed = sigv4_headers(method, url, query, headers or {}, payload,
                                   credentials, self._settings.s3_region)
            response = self._http.request(method, url + "?" + _canonical_query(query),
                                          headers=signed, content=payload or None)
            code = _s3_error_code(response.content) if response.content else None
            if response.is_success and code is None:
                return response
            status = response.status_code
            if status >= 500 or status in (408, 429) or code in ("SlowDown", "InternalError"):
                raise _Transient(f"HTTP {status} {code}")
            if status in (401, 403) or (code or "") in _DENIED_CODES:
                raise AccessDenied(f"the object store refused access to {what} (HTTP {status})")
            if status == 404 or (code or "") in (*_NOT_FOUND_CODES, "NoSuchUpload"):
                raise ObjectNotFound(f"{what} not found in the object store ({code})")
            raise SourceError(f"the object store answered HTTP {status} {code} for {what}")

        return call(send, what, self._settings) if retry else send()


@dataclass(frozen=True)
class InProgressUpload:
    """One multipart upload neither completed nor aborted (ListMultipartUploads)."""

    key: str
    upload_id: str
    initiated: datetime | None
    """When the store says it began; None when its answer has no readable ``Initiated``."""


def _timestamp(text: str | None) -> datetime | None:
    """An S3 timestamp (``2026-11-27T01:02:03.000Z``), None when absent or unreadable."""
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


class MultipartUploads(_SignedRequests):
    """The multipart uploads in progress under a prefix: ListMultipartUploads and
    AbortMultipartUpload (obstore has neither, and ``obstore.put`` leaves the upload of a failed
    streamed put in progress: its stored parts stay on the server, unlisted, until aborted)."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None,
                 read_timeout: float | None = None) -> None:
        super().__init__(bucket, settings, tenant,
                         stall_read_seconds(settings) if read_timeout is None else read_timeout)

    def in_progress(self, prefix: str, retry: bool = True) -> list[InProgressUpload]:
        """Every upload initiated under ``prefix``, neither completed nor aborted."""
        found: list[InProgressUpload] = []
        query = {"uploads": "", "prefix": prefix}
        while True:
            body = self._request("GET", "", query, retry=retry).content
            root = ElementTree.fromstring(body)
            for upload in root.findall("{*}Upload"):
                found.append(InProgressUpload(upload.findtext("{*}Key") or "",
                                              upload.findtext("{*}UploadId") or "",
                                              _timestamp(upload.findtext("{*}Initiated"))))
            if root.findtext("{*}IsTruncated") != "true":
                return found
            query = {**query, "key-marker": root.findtext("{*}NextKeyMarker") or "",
                     "upload-id-marker": root.findtext("{*}NextUploadIdMarker") or ""}

    def abort_all(
        self, prefix: str, retry: bool = True, initiated_before: datetime | None = None,
    ) -> int:
        """Abort every upload in progress under ``prefix`` (the store drops their parts), or
        only those initiated before ``initiated_before`` (one whose start the store does not
        say is kept: it may be live); returns how many. An upload completed or aborted
        meanwhile is not an error."""
        uploads = [u for u in self.in_progress(prefix, retry)
                   if initiated_before is None
                   or (u.initiated is not None and u.initiated < initiated_before)]
        for upload in uploads:
            with contextlib.suppress(ObjectNotFound):  # NoSuchUpload: already gone
                self._request("DELETE", upload.key, {"uploadId": upload.upload_id}, retry=retry)
        return len(uploads)


def abort_uploads(
    bucket: str, prefix: str, settings: Settings, tenant: str | None, *, quick: bool = False,
    initiated_before: datetime | None = None,
) -> int | None:
    """Best effort: abort the multipart uploads in progress under ``prefix``; returns how many,
    or None when that failed (the store or its STS unreachable, or no key pair to sign with:
    instance credentials stay inside object_store). ``quick``: one attempt with a short
    timeout, for cleaning up after a failure the store itself may have caused.
    ``initiated_before``: only uploads begun before then (:meth:`MultipartUploads.abort_all`).
    What is left is for the bucket's AbortIncompleteMultipartUpload lifecycle rule, a later
    removal, or the sweep of orphaned uploads."""
    try:
        uploads = MultipartUploads(bucket, settings, tenant,
                                   min(10.0, stall_read_seconds(settings)) if quick else None)
    except ServiceError:
        return None
    try:
        return uploads.abort_all(prefix, retry=not quick, initiated_before=initiated_before)
    except (ServiceError, _Transient, httpx.HTTPError, ElementTree.ParseError):
        return None
    finally:
        uploads.close()


class MultipartCopy(_SignedRequests):
    """Copy one object of a bucket to another key with UploadPartCopy, no byte through here.

    Each request goes through :func:`call` (retries, typed errors); a failure aborts the
    upload so the store drops the copied parts."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None) -> None:
        # a part copy answers when the store has copied the range: allow for 1 GiB of it
        super().__init__(bucket, settings, tenant,
                         min(600.0, max(60.0, settings.download_stall_seconds)))

    def copy(self, source: str, target: str, size: int, etag: str | None = None) -> str:
        """Copy ``source`` (``size`` bytes; ``etag``: refuse a source that changed meanwhile)
        to ``target`` in parts of :data:`COPY_PART_BYTES`; returns the new object's ETag."""
        created = self._request("POST", target, {"uploads": ""})
        upload_id = _element(created.content, "UploadId")
        try:
            parts = []
            copy_source = f"/{self._bucket}/{_quote_key(source)}"
            for number, start in enumerate(range(0, max(size, 1), COPY_PART_BYTES), 1):
                end = min(size, start + COPY_PART_BYTES) - 1
                headers = {"x-amz-copy-source": copy_source,
                           "x-amz-copy-source-range": f"bytes={start}-{end}"}
                if etag:
                    headers["x-amz-copy-source-if-match"] = etag
                copied = self._request("PUT", target, {"partNumber": str(number),
                                                       "uploadId": upload_id}, headers)
                parts.append((number, _element(copied.content, "ETag")))
            body = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>"
                           for n, e in parts)
            done = self._request(
                "POST", target, {"uploadId": upload_id},
                {"content-type": "application/xml"},
                f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode(),
            )
            return _element(done.content, "ETag")
        except BaseException:
            with contextlib.suppress(Exception):  # the store may be why it failed
                self._request("DELETE", target, {"uploadId": upload_id})
            raise
