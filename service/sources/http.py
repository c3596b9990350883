"""``http://`` and ``https://`` sources: one weights file, streamed to disk, resumed, verified.

The body is never held in memory: it goes chunk by chunk to ``.<name>.part`` next to the
destination, hashed on the way, and is renamed into place only when complete (and matching
``sha256`` when one was given). A dropped connection is retried with exponential backoff and
resumed with ``Range`` (guarded by ``If-Range`` so a file that changed meanwhile restarts from
zero); a server that ignores ``Range`` restarts the body from zero too.

With a ``sha256`` the file is content-addressed and goes to the shared download cache (two jobs
of the same file download it once); without one it is downloaded into the job's work directory.
The job's token is a Hub credential and is never sent to an arbitrary URL. Every connection,
each redirect hop included, goes through the egress policy (service/egress.py), and through
its proxy and CA bundle when the settings name them.

Why one module of over 450 lines: resuming is one protocol spread over three parts that must
agree on every byte count: the part file (:class:`PartWriter`, written and hashed on a thread
of its own through a bounded queue), one download across its attempts (:class:`_Download`:
``Range`` and ``If-Range``, the digest carried over, stall detection) and the fetcher that picks
the cache or the job's directory (:class:`HttpFetcher`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Self
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from service.checkpoint.headers import PROBE_BYTES, CheckpointHeaders, HeaderBuffer
from service.config import Settings
from service.egress import egress_client, transport_failure
from service.errors import (
    ChecksumMismatch,
    DiskFull,
    DownloadFailed,
    DownloadStalled,
    DownloadTooLarge,
    InvalidRequest,
    SourceError,
    SourceNotAllowed,
    SourceNotFound,
    SourceUnauthorized,
)
from service.fsutil import sha256_file
from service.retry import Backoff
from service.sources.base import ResolvedSource, SourceIdentity, SourceRequest
from service.sources.cache import DownloadCache
from service.stage import JobContext, Phase

BLOCK_BYTES = 2 * 1024 * 1024
"""Received bytes are handed to the writer thread, and progress reported, in blocks this big."""
WRITE_QUEUE_BLOCKS = 4
MAX_REDIRECTS = 10
_SCHEMES = ("http", "https")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,200}$")
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def public_url(url: str) -> str:
    """The URL as it may appear in messages: no query string (presigned URLs carry secrets)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}" \
        f"{parts.path}"


def file_name_of(url: str) -> str:
    """The last path segment, which names the file (its extension tells the checkpoint format)."""
    name = PurePosixPath(unquote(urlsplit(url).path)).name
    if not _FILE_NAME.match(name):
        raise InvalidRequest(f"URL {public_url(url)} does not end with a usable file name")
    return name


def check_http_url(url: str) -> None:
    """Submission-time checks that need no network."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise InvalidRequest(f"unsupported scheme {parts.scheme!r}")
    if not parts.hostname:
        raise InvalidRequest("URL has no host")
    if parts.username or parts.password:
        raise InvalidRequest("credentials in a source URL would be stored with the job; refused")
    file_name_of(url)


def check_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    value = sha256.strip().lower()
    if not _SHA256.match(value):
        raise InvalidRequest("sha256 must be 64 hexadecimal characters")
    return value


class PartWriter:
    """Appends received bytes to the part file and hashes them on a thread of its own.

    ``hashlib`` and file writes release the GIL, so receiving, hashing and writing overlap on
    different cores; received chunks are handed over as lists (no copy), so memory stays
    bounded by about ``(WRITE_QUEUE_BLOCKS + 2) * BLOCK_BYTES``. On exit (also after a cut
    connection) every byte fed is written, hashed and fsynced, so the caller's byte count always
    matches the file and a retry can resume at its end.
    """

    def __init__(self, path: Path, digest: Any | None) -> None:
        self._file = path.open("ab", buffering=0)
        self._digest = digest
        self._chunks: list[bytes] = []
        self.pending = 0
        self._queue: queue.Queue[list[bytes] | None] = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="download-writer", daemon=True)
        self._thread.start()

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self.pending += len(chunk)

    def hand_off(self) -> None:
        """Queue the pending chunks for the writer (waits while the queue is full)."""
        if self._error is not None:
            raise self._error
        self._queue.put(self._chunks)
        self._chunks, self.pending = [], 0

    def _run(self) -> None:
        while (chunks := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                block = b"".join(chunks)
                if self._digest is not None:
                    self._digest.update(block)
                view = memoryview(block)
                while view:
                    view = view[self._file.write(view) or 0:]
            except Exception as exc:  # noqa: BLE001 - re-raised in the receiving thread
                self._error = exc

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._chunks:
                self._queue.put(self._chunks)
                self._chunks, self.pending = [], 0
            self._queue.put(None)
            self._thread.join()
            if self._error is None:
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
        if self._error is not None:
            if isinstance(self._error, OSError) and self._error.errno == errno.ENOSPC:
                raise DiskFull(f"disk full while downloading to {self._file.name}") \
                    from self._error
            raise self._error


@dataclass
class _Attempt:
    """What the first response told us, kept across retries to validate resumed bodies."""

    total: int | None = None
    validator: str | None = None  # ETag or Last-Modified, for If-Range


def _final_response(
    client: httpx.Client, url: str, headers: dict[str, str]
) -> httpx.Response:
    """GET ``url`` following redirects by hand, refusing any hop to a non-http(s) scheme."""
    for _ in range(MAX_REDIRECTS + 1):
        response = client.send(client.build_request("GET", url, headers=headers), stream=True)
        if not response.is_redirect:
            return response
        location = response.headers.get("location", "")
        response.close()
        url = urljoin(url, location)
        if urlsplit(url).scheme not in _SCHEMES:
            raise SourceNotAllowed(f"redirect to a non-http(s) URL refused ({urlsplit(url).scheme})")
    raise DownloadFailed(f"more than {MAX_REDIRECTS} redirects")


class _StallWatch:
    """Fails a download whose rate over a ``download_stall_seconds`` window stays under
    ``download_min_bytes_per_second``: a trickle keeps the read timeout from ever firing."""

    def __init__(self, settings: Settings) -> None:
        self._window = settings.download_stall_seconds
        self._min_bytes = settings.download_min_bytes_per_second * settings.download_stall_seconds
        self.restart()

    def restart(self) -> None:
        self._since = time.monotonic()
        self._bytes = 0

    def received(self, n: int, url: str) -> None:
        self._bytes += n
        elapsed = time.monotonic() - self._since
        if elapsed < self._window:
            return
        if self._bytes < self._min_bytes:
            raise DownloadStalled(
                f"{public_url(url)} sent {self._bytes} bytes in {elapsed:.0f} s, less than "
                f"the {self._min_bytes / self._window:.0f} bytes/s required"
            )
        self.restart()


def _raise_for_status(response: httpx.Response, url: str) -> None:
    status = response.status_code
    if status in (401, 403):
        raise SourceUnauthorized(f"{public_url(url)} refused access (HTTP {status})")
    if status in (404, 410):
        raise SourceNotFound(f"{public_url(url)} not found (HTTP {status})")
    raise SourceError(f"{public_url(url)} answered HTTP {status}")


def download_file(
    url: str, dest: Path, settings: Settings, ctx: JobContext, sha256: str | None = None,
) -> int:
    """Stream ``url`` to ``dest``; returns the bytes received over the network.

    Raises DownloadTooLarge past ``settings.max_download_bytes``, ChecksumMismatch,
    SourceNotFound / SourceUnauthorized for 404 / 401-403, DownloadFailed once
    ``settings.download_retries`` consecutive attempts made no progress.
    """
    download = _Download(url, dest.with_name(f".{dest.name}.part"), settings, ctx, sha256)
    download.resume()
    backoff = Backoff(settings.download_retries, settings.download_backoff_seconds)
    # A silent server is a stalled one: the read timeout is the stall window too.
    timeout = httpx.Timeout(30.0, read=min(60.0, settings.download_stall_seconds))
    stall = _StallWatch(settings)
    with egress_client(settings.egress_policy, timeout) as client:
        while True:
            ctx.check_abort()
            try:
                if download.attempt(client, stall):
                    break
            except DownloadStalled:
                raise
            except (httpx.TransportError, DownloadFailed) as exc:
                if not backoff.failed(progressed=download.progressed):
                    raise DownloadFailed(
                        f"download of {public_url(url)} failed after {backoff.failures} "
                        f"attempts: {transport_failure(exc)}"
                    ) from exc
            except DownloadTooLarge:
                download.part.unlink(missing_ok=True)
                raise
    return download.finish(dest)


@dataclass
class _Download:
    """One file's download across attempts: the part file, the sha256 of its bytes so far
    (only when the job gave one to check: hashing is most of the CPU), and what the server
    said of the file (:class:`_Attempt`)."""

    url: str
    part: Path
    settings: Settings
    ctx: JobContext
    sha256: str | None
    digest: Any | None = None
    have: int = 0
    """Bytes in the part file."""
    received: int = 0
    """Bytes received over the network (a resumed part file's are not)."""
    progressed: bool = False
    """Whether the last attempt received any byte."""
    state: _Attempt = field(default_factory=_Attempt)

    def _new_digest(self) -> Any | None:
        return hashlib.sha256() if self.sha256 is not None else None

    def resume(self) -> None:
        """Continue from a part file left by an interrupted process: rehash it, start at its end."""
        self.digest = self._new_digest()
        if self.part.exists():
            with self.part.open("rb") as f:
                while block := f.read(BLOCK_BYTES):
                    if self.digest is not None:
                        self.digest.update(block)
                    self.have += len(block)

    def restart(self) -> None:
        """Drop the part file: the next bytes received are the file's first."""
        self.have, self.digest = 0, self._new_digest()
        self.part.unlink(missing_ok=True)

    def _headers(self) -> dict[str, str]:
        """Identity encoding (byte offsets must be the file's); a Range from the part file's
        end, valid only while the file is the one first seen (If-Range)."""
        headers = {"Accept-Encoding": "identity"}
        if self.have:
            headers["Range"] = f"bytes={self.have}-"
            if self.state.validator:
                headers["If-Range"] = self.state.validator
        return headers

    def attempt(self, client: httpx.Client, stall: _StallWatch) -> bool:
        """One request; True once the part file holds the whole file. Raises
        :class:`DownloadFailed` for what another attempt may cure."""
        self.progressed = False
        response = _final_response(client, self.url, self._headers())
        try:
            if response.status_code == 416 and self.have:
                match = re.match(r"bytes \*/(\d+)", response.headers.get("content-range", ""))
                if match is not None and int(match.group(1)) == self.have:
                    return True  # the part file is already complete
                self.restart()
                raise DownloadFailed("resume offset refused; restarting from zero")
            total = self._accept(response)
            self._receive(response, stall)
        finally:
            response.close()
        if total is None or self.have == total:
            return True
        raise DownloadFailed(f"body ended after {self.have} of {total} bytes")

    def _accept(self, response: httpx.Response) -> int | None:
        """Check a response before its body is read; the file's total size when announced."""
        if response.status_code in _RETRY_STATUS:
            raise DownloadFailed(f"HTTP {response.status_code}")
        if response.status_code not in (200, 206):
            _raise_for_status(response, self.url)
        start, total = _body_range(response)
        if start != self.have:  # Range ignored or answered elsewhere: restart from zero
            self.restart()
            if start != 0:
                raise DownloadFailed("server answered an unexpected byte range")
        limit = self.settings.max_download_bytes
        if total is not None and total > limit:
            raise DownloadTooLarge(
                f"{public_url(self.url)} is {total} bytes, more than the {limit} allowed"
            )
        self.state.total = total
        self.state.validator = response.headers.get("etag") or response.headers.get(
            "last-modified"
        )
        self.ctx.set_phase(Phase.DOWNLOAD, total, "bytes")
        self.ctx.advance(self.have)
        return total

    def _receive(self, response: httpx.Response, stall: _StallWatch) -> None:
        """Append the body to the part file, reporting progress and checking the size limit
        and cancellation once per block."""
        limit = self.settings.max_download_bytes
        with PartWriter(self.part, self.digest) as out:
            # No chunk_size: httpx's re-chunking buffer would lose bytes on a cut.
            stall.restart()
            for chunk in response.iter_raw():
                stall.received(len(chunk), self.url)
                out.feed(chunk)
                self.have += len(chunk)
                self.received += len(chunk)
                self.progressed = True
                if self.have > limit:
                    raise DownloadTooLarge(
                        f"{public_url(self.url)} exceeds the {limit} bytes allowed"
                    )
                if out.pending >= BLOCK_BYTES:
                    self.ctx.advance(out.pending)
                    out.hand_off()
                    self.ctx.check_abort()
            self.ctx.advance(out.pending)

    def finish(self, dest: Path) -> int:
        """Check the sha256 when one was given, then give the file its name; bytes received."""
        if self.digest is not None and self.digest.hexdigest() != self.sha256:
            self.part.unlink(missing_ok=True)
            raise ChecksumMismatch(
                f"{public_url(self.url)} has sha256 {self.digest.hexdigest()}, "
                f"expected {self.sha256}"
            )
        os.replace(self.part, dest)
        return self.received


def _body_range(response: httpx.Response) -> tuple[int, int | None]:
    """(first byte offset, total file size or None) of a 200 or 206 response."""
    if response.status_code == 206:
        match = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", response.headers.get("content-range", ""))
        if match is None:
            raise DownloadFailed("206 response without a usable Content-Range")
        total = match.group(3)
        return int(match.group(1)), (int(total) if total != "*" else None)
    length = response.headers.get("content-length")
    return 0, int(length) if length is not None and length.isdigit() else None


def remote_header(
    client: Any, url: str, name: str, headers: dict[str, str] | None = None
) -> tuple[int | None, HeaderBuffer | None]:
    """(file size when announced, the safetensors header of ``name`` or None for another
    format) of the file at ``url``, from range reads that stop after the header.

    ``client``: an ``httpx.Client``, or huggingface_hub's session (its vendored httpx, the
    same interface) for a hub file.

    A server that ignores ``Range`` answers with the whole file: its body is read only up to
    the end of the header, then the connection is closed."""
    buffer = HeaderBuffer(name) if name.endswith(".safetensors") else None
    start, size = 0, None
    while True:
        end = max(PROBE_BYTES, buffer.need if buffer is not None else 1) - 1
        asked = {**(headers or {}), "Accept-Encoding": "identity", "Range": f"bytes={start}-{end}"}
        response = _final_response(client, url, asked)
        try:
            if response.status_code not in (200, 206):
                _raise_for_status(response, url)
            first, total = _body_range(response)
            size = total if total is not None else size
            if buffer is None:
                return size, None
            if first != start:  # Range ignored: the body starts at byte 0
                buffer.data.clear()
            for chunk in response.iter_raw():
                if buffer.feed(chunk):
                    return size, buffer
        finally:
            response.close()
        if len(buffer.data) == start or (size is not None and len(buffer.data) >= size):
            buffer.tensors()  # the file ends inside its header: raises, naming the file
        start = len(buffer.data)


class HttpFetcher:
    schemes: tuple[str, ...] = _SCHEMES

    def headers(self, request: SourceRequest, settings: Settings) -> CheckpointHeaders:
        """The file's size and, for a safetensors file, its header (range reads that stop
        after it); an HTTP source is one weights file, without config.json."""
        self.check(request, settings)
        name = file_name_of(request.uri)
        timeout = httpx.Timeout(30.0, read=min(60.0, settings.download_stall_seconds))
        try:
            with egress_client(settings.egress_policy, timeout) as client:
                size, header = remote_header(client, request.uri, name)
        except httpx.TransportError as exc:
            raise DownloadFailed(
                f"reading the header of {public_url(request.uri)} failed: "
                f"{transport_failure(exc)}"
            ) from exc
        if size is None:
            raise DownloadFailed(f"{public_url(request.uri)} does not announce its size")
        fmt: Literal["safetensors", "pickle"] = "safetensors" if header is not None else "pickle"
        tensors = tuple(header.tensors()) if header is not None else ()
        return CheckpointHeaders(fmt, {name: size}, tensors, None, (name,), remote=True)

    def check(self, request: SourceRequest, settings: Settings) -> None:
        check_http_url(request.uri)
        check_sha256(request.sha256)
        settings.egress_policy.check_literal(request.uri)

    def identify(
        self,
        request: SourceRequest,
        settings: Settings,
        ctx: JobContext,
        fetched: ResolvedSource | None = None,
    ) -> SourceIdentity | None:
        """``sha256:<hex>`` of the file: the declared one at once, else hashed once fetched
        (the same key either way, so a job with a declared sha256 reuses one without)."""
        sha256 = check_sha256(request.sha256)
        if sha256 is None:
            if fetched is None:
                return None
            sha256 = sha256_file(fetched.path)
        return SourceIdentity(f"sha256:{sha256}", request)

    def fetch(self, request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
        check_http_url(request.uri)
        sha256 = check_sha256(request.sha256)
        name = file_name_of(request.uri)
        ctx.set_phase(Phase.DOWNLOAD, None, "bytes")
        if sha256 is None:
            target_dir = ctx.work_dir / "source"
            target_dir.mkdir(parents=True, exist_ok=True)
            downloaded = download_file(request.uri, target_dir / name, settings, ctx)
            path, hit = target_dir / name, False
        else:
            def fill(files: Path) -> int:
                received = download_file(request.uri, files / name, settings, ctx, sha256)
                for stray in files.glob(".*.part"):  # an earlier try under another URL's name
                    stray.unlink()
                return received

            entry = DownloadCache.from_settings(settings).acquire(
                f"sha256--{sha256}", fill,
                source={"uri": public_url(request.uri), "sha256": sha256},
            )
            # The cached file may carry the name of the first URL it came from.
            cached = sorted(p for p in entry.path.iterdir() if not p.name.startswith("."))
            path, hit, downloaded = cached[0], entry.hit, entry.bytes_downloaded
        ctx.set_metric("cache_hit", hit)
        ctx.add_metric("bytes_downloaded", downloaded)
        ctx.set_detail("source", {
            "uri": public_url(request.uri),
            "sha256": sha256,
            "files": [path.name],
            "bytes": path.stat().st_size,
            "cache_hit": hit,
        })
        return ResolvedSource(path=path, uri=request.uri, cache_hit=hit,
                              bytes_downloaded=downloaded)
