"""Where a job's ``adapter`` comes from: the source schemes, and an http(s) directory.

A PEFT LoRA adapter is two files (``service.checkpoint.lora.ADAPTER_FILES``). ``file://``,
``hf://`` and ``s3://`` name a directory (a repository, a prefix) and their fetchers bring both
(``checkpoint.AUX_PATTERNS`` holds ``adapter_config.json`` beside the weights). An http(s) URL
names one file, so for an adapter it names the directory the two files are under
(``https://host/loras/mine/``, or the URL of either file): each is downloaded as an HTTP source
is (egress policy on every hop, retries, resume), into the job's work directory. Its identity,
what result reuse keys on, is a hash over both files' names, sizes and sha256, known once they
are downloaded (an http(s) adapter has no declared digest).
"""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath
from urllib.parse import urlsplit, urlunsplit

from service.checkpoint.lora import ADAPTER_FILES
from service.config import Settings
from service.fsutil import sha256_file
from service.sources import check_source, fetch_source, identify_source
from service.sources.base import ResolvedSource, SourceIdentity, SourceRequest
from service.sources.http import check_http_url, download_file, public_url
from service.stage import JobContext, Phase

_HTTP = ("http", "https")


def is_http(request: SourceRequest) -> bool:
    return urlsplit(request.uri).scheme in _HTTP


def adapter_urls(uri: str) -> dict[str, str]:
    """Each adapter file's URL under the directory ``uri`` names (a URL ending in one of the
    files names its directory); the query string, a presigned URL's say, is kept for each."""
    parts = urlsplit(uri)
    path = PurePosixPath(parts.path or "/")
    directory = str(path.parent) if path.name in ADAPTER_FILES else str(path)
    directory = directory.rstrip("/")
    return {
        name: urlunsplit(parts._replace(path=f"{directory}/{name}", fragment=""))
        for name in ADAPTER_FILES
    }


def check_adapter_source(request: SourceRequest, settings: Settings) -> None:
    """Submission-time checks of a remote adapter's URI (no network), as for a source."""
    if not is_http(request):
        check_source(request, settings)
        return
    for url in adapter_urls(request.uri).values():
        check_http_url(url)
        settings.egress_policy.check_literal(url)


def fetch_adapter(request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
    """The adapter's files in a local directory."""
    if not is_http(request):
        return fetch_source(request, settings, ctx)
    target = ctx.work_dir / "adapter"
    target.mkdir(parents=True, exist_ok=True)
    ctx.set_phase(Phase.DOWNLOAD, None, "bytes")
    received = 0
    for name, url in adapter_urls(request.uri).items():
        received += download_file(url, target / name, settings, ctx)
    ctx.add_metric("bytes_downloaded", received)
    directory = public_url(adapter_urls(request.uri)[ADAPTER_FILES[0]]).rsplit("/", 1)[0] + "/"
    return ResolvedSource(path=target, uri=directory, bytes_downloaded=received)


def identify_adapter(
    request: SourceRequest,
    settings: Settings,
    ctx: JobContext,
    fetched: ResolvedSource | None = None,
) -> SourceIdentity | None:
    """The adapter's identity: its fetcher's, or for an http(s) adapter ``files:<hex>`` over
    the downloaded files (None before they are)."""
    if not is_http(request):
        return identify_source(request, settings, ctx, fetched)
    if fetched is None:
        return None
    combined = hashlib.sha256()
    for name in ADAPTER_FILES:
        path = fetched.path / name
        combined.update(f"{name}\0{path.stat().st_size}\0{sha256_file(path)}\n".encode())
    return SourceIdentity(f"files:{combined.hexdigest()}", request)
