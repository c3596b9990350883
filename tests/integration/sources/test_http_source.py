"""http(s) sources against a real loopback server that cuts connections and misbehaves."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.config import Settings
from service.errors import (
    ChecksumMismatch,
    DownloadFailed,
    DownloadStalled,
    DownloadTooLarge,
    JobCancelled,
    SourceNotAllowed,
    SourceNotFound,
    SourceUnauthorized,
)
from service.sources import SourceRequest, fetch_source
from service.stage import InMemoryContext, Phase
from tests.fixtures.http_server import FileServer, Route

SIZE = 3 * 1024 * 1024 + 12345


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    path = tmp_path / "served" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", download_retries=2, download_backoff_seconds=0.01,
                    egress_allowlist=["127.0.0.0/8"])


def _ctx(settings: Settings, name: str = "job") -> InMemoryContext:
    work = settings.data_dir / "jobs" / name
    work.mkdir(parents=True, exist_ok=True)
    return InMemoryContext(settings=settings, work_dir=work, job_id=name)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cut_connection_is_resumed_with_range_and_checksum_matches(
    http_server: FileServer, payload: Path, settings: Settings
) -> None:
    url = http_server.add("/m/model.safetensors", Route(body=payload, cut_after=1_000_000, cuts=2))
    ctx = _ctx(settings)
    resolved = fetch_source(SourceRequest(url, sha256=_sha(payload)), settings, ctx)

    assert resolved.path.read_bytes() == payload.read_bytes()
    assert resolved.bytes_downloaded == SIZE  # resumed, nothing fetched twice
    ranges = [s.headers.get("Range") for s in http_server.seen]
    assert ranges == [None, "bytes=1000000-", "bytes=2000000-"]
    assert ctx.metrics == {"cache_hit": False, "bytes_downloaded": SIZE}
    assert (ctx.phase, ctx.done, ctx.total) == (Phase.DOWNLOAD, SIZE, SIZE)
    assert not list(resolved.path.parent.glob(".*.part"))


def test_later_job_resumes_the_part_file_a_cancelled_job_left(
    http_server: FileServer, tmp_path: Path, settings: Settings
) -> None:
    big = tmp_path / "big.safetensors"
    big.write_bytes(os.urandom(24 * 1024 * 1024))
    url = http_server.add("/big.safetensors", Route(body=big))
    cancelled = _CancelAfterFirstChunk(settings=settings, work_dir=tmp_path / "a")
    with pytest.raises(JobCancelled):
        fetch_source(SourceRequest(url, sha256=_sha(big)), settings, cancelled)

    ctx = _ctx(settings, "b")
    resolved = fetch_source(SourceRequest(url, sha256=_sha(big)), settings, ctx)
    assert _sha(resolved.path) == _sha(big)
    resumed_at = int(str(http_server.seen[-1].headers.get("Range")).split("=")[1].rstrip("-"))
    assert 0 < resumed_at < big.stat().st_size
    assert resolved.bytes_downloaded == big.stat().st_size - resumed_at
    assert (ctx.done, ctx.total) == (big.stat().st_size, big.stat().st_size)


def test_server_ignoring_range_restarts_from_zero(
    http_server: FileServer, payload: Path, settings: Settings
) -> None:
    url = http_server.add("/model.safetensors",
                          Route(body=payload, cut_after=500_000, honor_range=False))
    resolved = fetch_source(SourceRequest(url, sha256=_sha(payload)), settings, _ctx(settings))
    assert _sha(resolved.path) == _sha(payload)
    assert resolved.bytes_downloaded == SIZE + 500_000


def test_second_job_with_same_sha256_is_a_cache_hit(
    http_server: FileServer, payload: Path, settings: Settings
) -> None:
    url = http_server.add("/model.safetensors", Route(body=payload))
    first = fetch_source(SourceRequest(url, sha256=_sha(payload)), settings, _ctx(settings, "a"))
    ctx = _ctx(settings, "b")
    second = fetch_source(SourceRequest(url, sha256=_sha(payload)), settings, ctx)
    assert second.path == first.path and second.cache_hit
    assert ctx.metrics == {"cache_hit": True, "bytes_downloaded": 0}
    assert len(http_server.seen) == 1


def test_without_sha256_the_file_goes_to_the_job_work_dir(
    http_server: FileServer, payload: Path, settings: Settings
) -> None:
    url = http_server.add("/x/model.safetensors", Route(body=payload))
    ctx = _ctx(settings)
    resolved = fetch_source(SourceRequest(url), settings, ctx)
    assert resolved.path == ctx.work_dir / "source" / "model.safetensors"
    assert _sha(resolved.path) == _sha(payload)


def test_wrong_sha256_raises_checksum_mismatch_and_keeps_nothing(
    http_server: FileServer, payload: Path, settings: Settings
) -> None:
    url = http_server.add("/model.safetensors", Route(body=payload))
    with pytest.raises(ChecksumMismatch):
        fetch_source(SourceRequest(url, sha256="0" * 64), settings, _ctx(settings))
    leftovers = [p for p in settings.cache_dir.rglob("*") if p.is_file() and "locks" not in p.parts]
    assert leftovers == []


@pytest.mark.parametrize(("status", "error"), [
    (404, SourceNotFound), (401, SourceUnauthorized), (403, SourceUnauthorized),
])
def test_http_errors_map_to_typed_errors(
    http_server: FileServer, settings: Settings, status: int, error: type[Exception]
) -> None:
    url = http_server.add("/model.safetensors", Route(status=status, body=b"no"))
    with pytest.raises(error):
        fetch_source(SourceRequest(url), settings, _ctx(settings))
    assert len(http_server.seen) == 1  # not retried


def test_missing_path_is_source_not_found(http_server: FileServer, settings: Settings) -> None:
    with pytest.raises(SourceNotFound):
        fetch_source(SourceRequest(http_server.url("/nope.safetensors")), settings, _ctx(settings))


def test_redirects_are_followed(
    http_server: FileServer, payload: Path, settings: Settings
) -> None:
    http_server.add("/real/model.safetensors", Route(body=payload))
    url = http_server.add("/model.safetensors",
                          Route(status=302, headers={"Location": "/real/model.safetensors"}))
    resolved = fetch_source(SourceRequest(url, sha256=_sha(payload)), settings, _ctx(settings))
    assert _sha(resolved.path) == _sha(payload)


def test_redirect_to_another_scheme_is_refused(
    http_server: FileServer, settings: Settings
) -> None:
    url = http_server.add("/model.safetensors",
                          Route(status=301, headers={"Location": "file:///etc/passwd"}))
    with pytest.raises(SourceNotAllowed):
        fetch_source(SourceRequest(url), settings, _ctx(settings))


def test_file_larger_than_the_limit_is_refused_before_download(
    http_server: FileServer, payload: Path, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "d", max_download_bytes=SIZE - 1,
                        egress_allowlist=["127.0.0.0/8"])
    url = http_server.add("/model.safetensors", Route(body=payload))
    ctx = _ctx(settings)
    with pytest.raises(DownloadTooLarge):
        fetch_source(SourceRequest(url), settings, ctx)
    assert ctx.done == 0


def test_unreachable_server_fails_after_retries(settings: Settings) -> None:
    with pytest.raises(DownloadFailed, match="after 3 attempts"):
        fetch_source(SourceRequest("http://127.0.0.1:9/model.safetensors"), settings,
                     _ctx(settings))


def test_persistent_server_errors_fail_after_retries(
    http_server: FileServer, settings: Settings
) -> None:
    url = http_server.add("/model.safetensors", Route(status=503, body=b"busy"))
    with pytest.raises(DownloadFailed):
        fetch_source(SourceRequest(url), settings, _ctx(settings))
    assert len(http_server.seen) == settings.download_retries + 1


@dataclass
class _CancelAfterFirstChunk(InMemoryContext):
    """A job whose user cancels it once some bytes arrived."""

    def advance(self, n: int) -> None:
        super().advance(n)
        if self.done > 0:
            self.cancel_event.set()


def test_cancellation_stops_the_download(
    http_server: FileServer, payload: Path, settings: Settings, tmp_path: Path
) -> None:
    big = tmp_path / "big.safetensors"
    big.write_bytes(os.urandom(40 * 1024 * 1024))
    url = http_server.add("/big.safetensors", Route(body=big))
    ctx = _CancelAfterFirstChunk(settings=settings, work_dir=tmp_path / "w")
    with pytest.raises(JobCancelled):
        fetch_source(SourceRequest(url), settings, ctx)
    assert ctx.done < big.stat().st_size


def test_a_trickling_source_fails_as_stalled_without_retries(
    http_server: FileServer, payload: Path, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "d", egress_allowlist=["127.0.0.0/8"],
                        download_stall_seconds=0.5, download_min_bytes_per_second=1_000_000)
    url = http_server.add("/slow/model.safetensors", Route(body=payload, bytes_per_second=50_000))
    started = time.monotonic()
    with pytest.raises(DownloadStalled, match="bytes/s required"):
        fetch_source(SourceRequest(url), settings, _ctx(settings))
    assert time.monotonic() - started < 10
    assert len(http_server.seen) == 1
