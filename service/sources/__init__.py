"""Source fetchers by URI scheme."""

from __future__ import annotations

from urllib.parse import urlparse

from service.config import Settings
from service.errors import InvalidRequest
from service.sources.base import ResolvedSource, SourceFetcher, SourceIdentity, SourceRequest
from service.sources.http import HttpFetcher
from service.sources.hub import HubFetcher
from service.sources.local import LocalFetcher, LocalSource
from service.sources.s3 import S3Fetcher
from service.stage import JobContext

_FETCHERS: list[SourceFetcher] = [LocalFetcher(), HubFetcher(), HttpFetcher(), S3Fetcher()]


def fetcher_for(uri: str) -> SourceFetcher:
    scheme = urlparse(uri).scheme
    for fetcher in _FETCHERS:
        if scheme in fetcher.schemes:
            return fetcher
    known = sorted(s for f in _FETCHERS for s in f.schemes)
    raise InvalidRequest(f"unsupported source scheme {scheme!r}; use one of {known}")


def check_source(request: SourceRequest, settings: Settings) -> None:
    fetcher_for(request.uri).check(request, settings)


def local_source(request: SourceRequest, settings: Settings) -> LocalSource | None:
    """The source resolved and checked once, when it is a local one (``file://``); None for a
    remote source, which is known only once downloaded."""
    fetcher = fetcher_for(request.uri)
    return fetcher.resolve(request, settings) if isinstance(fetcher, LocalFetcher) else None


def fetch_source(request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
    return fetcher_for(request.uri).fetch(request, settings, ctx)


def identify_source(
    request: SourceRequest,
    settings: Settings,
    ctx: JobContext,
    fetched: ResolvedSource | None = None,
) -> SourceIdentity | None:
    """The identity of the source's bytes (see :meth:`SourceFetcher.identify`)."""
    return fetcher_for(request.uri).identify(request, settings, ctx, fetched)


__all__ = [
    "LocalSource",
    "ResolvedSource",
    "SourceIdentity",
    "SourceRequest",
    "check_source",
    "fetch_source",
    "fetcher_for",
    "identify_source",
    "local_source",
]
