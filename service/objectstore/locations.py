"""Where objects are: ``s3://`` locations, validated so that a location never names a key outside
its prefix, and the endpoint requests and presigned URLs go to."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from service.config import Settings
from service.errors import EgressRefused, InvalidRequest

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

_SEGMENT = re.compile(r"^[A-Za-z0-9!_.*'()+=@,;:$&-][A-Za-z0-9!_.*'()+=@,;:$& -]{0,254}$")


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

def public_endpoint_of(settings: Settings) -> str:
    """The endpoint presigned URLs name: where clients outside the service's network reach the
    store (``s3_public_endpoint``), else the one the service uses."""
    if settings.s3_public_endpoint:
        return settings.s3_public_endpoint.rstrip("/")
    return endpoint_of(settings)

def describe_endpoint(settings: Settings) -> str:
    """The endpoint, where it comes from and what would change it, for a message: the
    operator who meant another store sees which variable to set."""
    if settings.s3_endpoint:
        where = settings.origin("s3_endpoint")
    else:
        where = (f"AWS S3 of region {settings.s3_region}, {settings.origin('s3_region')}; "
                 f"another store is set by {settings.variables_of('s3_endpoint')}")
    parts = urlsplit(endpoint_of(settings))
    proxy = settings.proxy_routes.for_target(parts.scheme, parts.hostname or "")
    through = f"; through {settings.proxy_routes.describe(proxy)}" if proxy else ""
    return f"{endpoint_of(settings)} ({where}{through})"


def check_egress(settings: Settings) -> None:
    """The egress policy applied to the endpoint: it must resolve to an address the policy
    allows (every address, through a proxy). ``object_store`` connects by itself, so the
    address is checked, not pinned. A refusal names the endpoint and its variables."""
    parts = urlsplit(endpoint_of(settings))
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = settings.proxy_routes.for_target(parts.scheme, host)
    try:
        if proxy is not None:
            settings.store_egress_policy.check_through_proxy(host, port, proxy)
        else:
            settings.store_egress_policy.resolve(host, port)
    except EgressRefused as exc:
        raise EgressRefused(
            f"the object store endpoint {describe_endpoint(settings)}: {exc.message}"
        ) from None
