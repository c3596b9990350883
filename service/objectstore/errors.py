"""An object-store failure to a typed error, and one call retried until it is one.

Error mapping (:func:`classify`): a missing bucket or key is :class:`ObjectNotFound`, a refused
signature, unknown key or missing permission :class:`AccessDenied`, bytes that do not match
the checksum sent with them (``BadDigest``) :class:`ChecksumMismatch`, a server certificate the
store's CA bundle does not trust :class:`CertificateUntrusted` at once (another attempt meets the
same certificate; the message names ``MODELPREP_S3_CA_BUNDLE``, ``AWS_CA_BUNDLE`` and the general
bundle's variables), a connection failure a transient error that is retried and then
:class:`SourceUnreachable`. ``obstore`` raises typed
exceptions for object requests (NotFoundError, PermissionDeniedError, UnauthenticatedError)
but a bare ``GenericError`` for listings; for those the HTTP status and S3 error code in its
message are read (tests/unit/objectstore/test_objectstore.py pins that assumption). botocore's
requests (service/objectstore/aws.py) fail with ``ClientError``, whose status and S3 error code
are mapped the same way, or with a connection failure of the egress client, retried."""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from typing import TypeVar

import httpx
from botocore.exceptions import BotoCoreError, ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from service.config import Settings, setting_variables
from service.errors import (
    AccessDenied,
    CertificateUntrusted,
    ChecksumMismatch,
    DiskFull,
    InvalidRequest,
    ObjectNotFound,
    ServiceError,
    SourceError,
    SourceUnreachable,
)
from service.objectstore.aws import error_of
from service.objectstore.locations import describe_endpoint
from service.retry import Backoff

T = TypeVar("T")

_STATUS = re.compile(r"non-2xx status code: (\d{3})")

_NOT_FOUND_CODES = ("NoSuchBucket", "NoSuchKey", "NotFound")

_DENIED_CODES = (
    "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken",
    "ExpiredToken", "AllAccessDisabled",
)  # fmt: skip


_DIGEST_CODES = ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest")
"""What a server answers a part whose bytes do not match the checksum sent with it."""


_CERTIFICATE = re.compile(r"InvalidCertificate\(\s*(\w+)")
"""rustls's refusal of the server's certificate in obstore's message (``UnknownIssuer``,
``NotValidForName``, ``Expired``...); tests/unit/objectstore/test_store_ca.py pins it against a
real TLS server."""


def untrusted_store(what: str, reason: str, settings: Settings | None) -> CertificateUntrusted:
    """The typed error of a store certificate that the store's CA bundle does not trust,
    naming the bundle in use (when ``settings`` are at hand) and every variable that sets it."""
    names = setting_variables("s3_ca_bundle")
    variables = ", ".join(names[:-1]) + " or " + names[-1]
    if settings is None:
        where, trusted = "the object store", "the store's CA bundle"
    else:
        where = f"the object store at {describe_endpoint(settings)}"
        bundle = settings.s3_ca_bundle
        trusted = (f"the CA bundle {bundle} ({settings.source_of('s3_ca_bundle')})"
                   if bundle is not None else "the public CA roots")
    return CertificateUntrusted(
        f"the TLS certificate of {where} is not trusted by {trusted} ({reason}, for {what}); "
        f"name its CA's bundle in {variables}"
    )


def _status(message: str) -> int | None:
    match = _STATUS.search(message)
    return int(match.group(1)) if match else None


_PROVIDER_FAILED = "External AWS credential provider: "

_PROVIDER_ERROR = re.compile(re.escape(_PROVIDER_FAILED) + r"(\w+): ([^\n]*)")


def _provider_failure(message: str, what: str) -> ServiceError:
    """The typed error of a ``credential_provider`` callback that raised: obstore reports it as
    UnauthenticatedError ``External AWS credential provider: <class>: <message>`` (the
    callback is :class:`~service.objectstore.web_identity.WebIdentityCredentials`, whose
    messages hold neither token nor key). An STS that could not be reached stays
    SourceUnreachable."""
    match = _PROVIDER_ERROR.search(message)
    name, detail = (match.group(1), match.group(2)) if match else ("", message.splitlines()[0])
    if name == SourceUnreachable.__name__:
        return SourceUnreachable(f"{what}: {detail}")
    if name == CertificateUntrusted.__name__:  # the STS's certificate: its message names it
        return CertificateUntrusted(detail)
    return AccessDenied(f"no credentials for {what}: {detail}")

def classify(
    exc: BaseException, what: str, settings: Settings | None = None,
) -> ServiceError | None:
    """The typed error for an object-store failure about ``what`` (a location, never a key
    pair), or None when another attempt may succeed (connection failures, 5xx, throttling).
    ``settings``: what an untrusted certificate's message names (the bundle in use)."""
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
        refused = _CERTIFICATE.search(message)
        if refused is not None:
            return untrusted_store(what, refused.group(1), settings)
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
    if isinstance(exc, ClientError):
        return _client_error(exc, what)
    if isinstance(exc, httpx.TransportError | BotoConnectionError | ResponseParserError):
        return None  # a dropped connection, or a gateway's page where an answer should be
    if isinstance(exc, BotoCoreError):  # a request botocore refused to build
        return SourceError(f"the request about {what} failed: {type(exc).__name__}")
    if isinstance(exc, ValueError):  # obstore's path parsing
        return InvalidRequest(f"refused object path for {what}")
    return None


def _client_error(exc: ClientError, what: str) -> ServiceError | None:
    """:func:`classify` of botocore's error answer (S3 may answer a copy with 200 and an error
    document: botocore turns that into the error it holds)."""
    status, code, _ = error_of(exc)
    if status == 404 or code in (*_NOT_FOUND_CODES, "NoSuchUpload"):
        return ObjectNotFound(f"{what} not found in the object store ({code})")
    if status in (401, 403) or code in _DENIED_CODES:
        return AccessDenied(f"the object store refused access to {what} (HTTP {status})")
    if (status or 500) >= 500 or status in (408, 429) or code in ("SlowDown", "InternalError"):
        return None
    return SourceError(f"the object store answered HTTP {status} {code} for {what}")

def call(fn: Callable[[], T], what: str, settings: Settings) -> T:
    """Run one object-store call, retrying transient failures with backoff; every failure
    ends as a typed error (:class:`SourceUnreachable` once retries are exhausted)."""
    backoff = Backoff(settings.download_retries, settings.download_backoff_seconds)
    while True:
        try:
            return fn()
        except Exception as exc:  # every failure is classified below, none is swallowed
            mapped = classify(exc, what, settings)
            if mapped is not None:
                if mapped is exc:
                    raise
                raise mapped from exc
            if not backoff.failed():
                raise SourceUnreachable(
                    f"the object store at {describe_endpoint(settings)} did not answer for "
                    f"{what} after {backoff.failures} attempts"
                ) from exc
