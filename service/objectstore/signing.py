"""S3 requests obstore cannot make, signed here (AWS SigV4, header form) and sent with httpx.

The signature (:func:`sigv4_headers`) uses the keys :func:`~service.objectstore.credentials.
static_credentials` finds, the same ones :func:`~service.objectstore.store.store_for` hands
obstore; :class:`_SignedRequests` is the base of the multipart requests
(service/objectstore/multipart.py)."""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

import httpx

from service.config import Settings
from service.errors import AccessDenied, ObjectNotFound, SourceError
from service.objectstore.credentials import StaticCredentials, static_credentials
from service.objectstore.errors import _DENIED_CODES, _NOT_FOUND_CODES, call
from service.objectstore.locations import endpoint_of

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


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
