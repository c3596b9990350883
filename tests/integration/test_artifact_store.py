"""The artifact store against a real S3 server (SeaweedFS on loopback): publication with the
manifest last, presigned downloads with Range, removal, grants, and a server stopped mid-upload.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import obstore
import pytest
from obstore.store import S3Store

from service.config import Settings
from service.errors import (
    ChecksumMismatch,
    Forbidden,
    InvalidRequest,
    JobCancelled,
    PublishFailed,
)
from service.fsutil import sha256_file
from service.jobs.artifact_store import MANIFEST, ArtifactStore, check_destination
from service.objectstore import (
    COPY_OBJECT_MAX_BYTES,
    COPY_PART_BYTES,
    MultipartUploads,
    S3Location,
    abort_uploads,
)
from service.stage import InMemoryContext
from tests.fixtures.corrupting_proxy import corrupting_proxy
from tests.fixtures.seaweedfs import (  # noqa: F401  (fixture)
    S3Server,
    seaweedfs,
    start_seaweedfs,
    stop_seaweedfs,
)
from tests.fixtures.waiting import eventually

STALL_SECONDS = 6
"""The stall bound of the tests that stop the server mid-publish: the publish must not fail on
a slow answer before the stop, only on the stopped server after it."""


def _stopping_after(
    tmp_path: Path, settings: Settings, after: int, stop: Callable[[], None]
) -> tuple[InMemoryContext, threading.Event]:
    """A job context that calls ``stop`` once, when more than ``after`` bytes are published;
    the event says it did."""
    ctx = InMemoryContext(settings=settings, work_dir=tmp_path / "work")
    stopped = threading.Event()
    original = ctx.advance

    def advance(n: int) -> None:
        original(n)
        if not stopped.is_set() and ctx.done > after:
            stop()
            stopped.set()

    ctx.advance = advance  # type: ignore[method-assign]
    return ctx, stopped


@pytest.fixture(autouse=True)
def _service_keys(monkeypatch: pytest.MonkeyPatch, seaweedfs: S3Server) -> None:  # noqa: F811
    """The service's own keys come from the standard chain (the environment here)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)


@pytest.fixture
def bucket(seaweedfs: S3Server) -> str:  # noqa: F811
    name = f"art-{uuid.uuid4().hex[:12]}"
    seaweedfs.create_bucket(name)
    return name


def _settings(tmp_path: Path, server: S3Server, bucket: str, **extra: object) -> Settings:
    return Settings(data_dir=tmp_path / "data", s3_endpoint=server.endpoint,
                    artifact_store=f"s3://{bucket}/artifacts", download_retries=1,
                    download_backoff_seconds=0.01, **extra)  # type: ignore[arg-type]


def _staging(root: Path, sizes: dict[str, int]) -> dict[str, str]:
    digests = {}
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size)
        path.write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    (root / MANIFEST).write_text(json.dumps({"files": digests}))
    return digests


def _keys(server: S3Server, bucket: str, prefix: str) -> list[str]:
    store = S3Store(bucket, endpoint=server.endpoint, region="us-east-1",
                    access_key_id=server.access_key, secret_access_key=server.secret_key,
                    client_options={"allow_http": True})
    return sorted(str(m["path"]) for batch in obstore.list(store, prefix) for m in batch)


def test_publish_uploads_every_file_then_the_manifest_and_serves_presigned_ranges(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    settings = _settings(tmp_path, seaweedfs, bucket)
    store = ArtifactStore.configured(settings)
    assert store is not None
    staging = tmp_path / "staging"
    # 20 MiB: two parts of a multipart upload, each sent with its SHA-256.
    digests = _staging(staging, {"gguf/model.gguf": 20 * 1024 * 1024, "small.json": 100})
    location = store.location_for("0" * 32, "acme")
    assert location.uri == f"s3://{bucket}/artifacts/acme/{'0' * 32}"
    ctx = InMemoryContext(settings=settings, work_dir=tmp_path / "work")
    etags = store.publish(staging, location, digests, ctx)
    assert sorted(etags) == sorted([*digests, MANIFEST])
    assert ctx.done == sum((staging / n).stat().st_size for n in [*digests, MANIFEST])
    assert store.published(location)
    assert store.manifest(location) == {"files": digests}
    prefix = f"artifacts/acme/{'0' * 32}"
    assert _keys(seaweedfs, bucket, prefix) == sorted(f"{prefix}/{n}" for n in etags)

    url = store.url(location, "gguf/model.gguf")
    assert seaweedfs.secret_key not in url
    whole = httpx.get(url)
    assert whole.status_code == 200
    assert hashlib.sha256(whole.content).hexdigest() == digests["gguf/model.gguf"]
    part = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == whole.content[100:200]
    assert whole.headers["etag"].strip('"') == etags["gguf/model.gguf"].strip('"')

    freed = store.remove(location)
    assert freed == sum((staging / n).stat().st_size for n in [*digests, MANIFEST])
    assert not store.published(location)
    assert _keys(seaweedfs, bucket, prefix) == []


def test_server_stopped_mid_upload_fails_typed_and_publishes_nothing(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    # A stall bound that a loaded machine's slow answer does not reach before the stop (at 2 s
    # the publish sometimes failed before the server was stopped, under a load of 3.5), yet
    # short enough that the stopped server fails the publish in seconds.
    settings = _settings(tmp_path, seaweedfs, bucket, download_stall_seconds=STALL_SECONDS)
    store = ArtifactStore.configured(settings)
    assert store is not None
    staging = tmp_path / "staging"
    digests = _staging(staging, {"a.bin": 1024, "b.bin": 40 * 1024 * 1024})
    location = store.location_for("1" * 32, None)
    # inside b.bin's first parts
    ctx, stopped = _stopping_after(tmp_path, settings, 8 * 1024 * 1024,
                                   lambda: os.kill(seaweedfs.pid, signal.SIGSTOP))  # fmt: skip
    try:
        with pytest.raises(PublishFailed) as failed:
            store.publish(staging, location, digests, ctx)
    finally:
        os.kill(seaweedfs.pid, signal.SIGCONT)
    assert stopped.is_set()
    assert failed.value.code == "publish_failed"
    assert not store.published(location)
    keys = _keys(seaweedfs, bucket, f"artifacts/_/{'1' * 32}")
    assert f"artifacts/_/{'1' * 32}/{MANIFEST}" not in keys
    status, _ = seaweedfs.request("GET", "/")  # the server answers again once resumed
    assert status == 200
    # b.bin's multipart upload could not be aborted while the server was stopped: the job's
    # next attempt aborts it before publishing, so its parts do not stay behind unseen.
    prefix = f"artifacts/_/{'1' * 32}/"
    assert seaweedfs.multipart_uploads(bucket, prefix) == [f"{prefix}b.bin"]
    store.publish(staging, location, digests)
    assert seaweedfs.multipart_uploads(bucket, prefix) == []
    assert store.published(location)
    store.remove(location)
    assert _keys(seaweedfs, bucket, prefix) == []


def test_the_cleanup_before_a_publish_gives_up_on_a_stopped_server_within_the_stall_bound(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    """Publishing first aborts what an earlier attempt left in progress; against a server that
    accepts connections and never answers, each of its requests waits download_stall_seconds
    (as an upload's does), not a fixed minute, so the publication fails as soon as it would."""
    settings = _settings(tmp_path, seaweedfs, bucket, download_stall_seconds=2)
    os.kill(seaweedfs.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        aborted = abort_uploads(bucket, "artifacts/_/", settings, None)
    finally:
        os.kill(seaweedfs.pid, signal.SIGCONT)
    elapsed = time.monotonic() - started
    assert aborted is None  # best effort: the store did not answer
    # 2 attempts (download_retries=1) of 2 s each, plus the backoff: a fixed 60 s read took 120
    assert elapsed < 30, f"the cleanup waited {elapsed:.1f} s on a stopped store"


def _initiated(bucket: str, settings: Settings) -> dict[str, list[datetime]]:
    """When each upload in progress in ``bucket`` began (per key), as the server says."""
    uploads = MultipartUploads(bucket, settings, None)
    try:
        found = uploads.in_progress("")
    finally:
        uploads.close()
    started: dict[str, list[datetime]] = {}
    for upload in found:
        assert upload.initiated is not None, upload
        started.setdefault(upload.key, []).append(upload.initiated)
    return started


def test_the_sweep_aborts_the_orphan_of_a_publish_that_failed_while_the_server_was_down(
    tmp_path: Path,
) -> None:
    """A job fails while the server is down and is never retried: its multipart upload stays
    in progress once the server is back. The sweep aborts uploads under the store's prefix
    older than ``artifact_upload_orphan_after``, and keeps younger ones (a live publish) and
    those outside the prefix.

    Its own server: stopped mid-upload (SIGSTOP), then killed and restarted on the same data
    and address, so requests the failed job sent to the stopped server die with it rather
    than create or abort uploads behind the test's back once it resumes."""
    proc, server = start_seaweedfs(tmp_path / "s3")
    try:
        bucket = "sweep"
        server.create_bucket(bucket)
        settings = _settings(tmp_path, server, bucket, download_stall_seconds=STALL_SECONDS,
                             artifact_upload_orphan_after=1)
        store = ArtifactStore.configured(settings)
        assert store is not None
        staging = tmp_path / "staging"
        digests = _staging(staging, {"b.bin": 40 * 1024 * 1024})
        location = store.location_for("6" * 32, None)
        prefix = location.prefix + "/"

        def stop() -> None:
            eventually(lambda: server.multipart_uploads(bucket, prefix) != [],
                       what="the server to hold b.bin's multipart upload", timeout=60)
            os.kill(server.pid, signal.SIGSTOP)

        # b.bin's first part is out
        ctx, stopped = _stopping_after(tmp_path, settings, 24 * 1024 * 1024, stop)
        with pytest.raises(PublishFailed):
            store.publish(staging, location, digests, ctx)
        assert stopped.is_set()
        stop_seaweedfs(proc)
        proc, server = start_seaweedfs(tmp_path / "s3", restart=server)
        assert server.multipart_uploads(bucket, prefix) == [f"{prefix}b.bin"]
        [orphan_started] = _initiated(bucket, settings)[f"{prefix}b.bin"]
        # A live publish under the store, begun 2 s after the orphan (Initiated has whole
        # seconds), and an upload outside the store's prefix.
        time.sleep(max(0.0, (orphan_started + timedelta(seconds=2) - datetime.now(UTC))
                       .total_seconds()))
        live, outside = f"artifacts/_/{'7' * 32}/c.bin", "elsewhere/d.bin"
        for key in (live, outside):
            status, body = server.request("POST", f"/{bucket}/{key}", query={"uploads": ""})
            assert status == 200, (status, body)
        [live_started] = _initiated(bucket, settings)[live]
        assert live_started - orphan_started >= timedelta(seconds=2)

        # Right after the failure nothing is old enough.
        assert store.abort_orphaned_uploads(now=orphan_started) == 0
        assert server.multipart_uploads(bucket, prefix) == [f"{prefix}b.bin"]
        # Once the orphan is older than the bound, but the live upload not.
        assert store.abort_orphaned_uploads(now=live_started + timedelta(seconds=1)) == 1
        assert server.multipart_uploads(bucket, prefix) == []
        assert server.multipart_uploads(bucket, "artifacts/") == [live]
        assert server.multipart_uploads(bucket, "elsewhere/") == [outside]
        assert not store.published(location)
    finally:
        stop_seaweedfs(proc)


def test_a_job_cancelled_mid_upload_aborts_its_multipart_upload_on_the_server(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    """Cancelled inside a multipart upload (parts already stored): the upload is aborted on
    the server (obstore.put leaves it in progress), the completed file deleted, no manifest."""
    settings = _settings(tmp_path, seaweedfs, bucket)
    store = ArtifactStore.configured(settings)
    assert store is not None
    staging = tmp_path / "staging"
    digests = _staging(staging, {"a.bin": 1024, "b.bin": 40 * 1024 * 1024})
    location = store.location_for("5" * 32, None)
    ctx = InMemoryContext(settings=settings, work_dir=tmp_path / "work")
    original = ctx.advance

    def advance(n: int) -> None:
        original(n)
        if ctx.done > 24 * 1024 * 1024:  # b.bin's first part sent, its second under way
            ctx.cancel_event.set()

    ctx.advance = advance  # type: ignore[method-assign]
    with pytest.raises(JobCancelled):
        store.publish(staging, location, digests, ctx)
    prefix = location.prefix + "/"
    assert seaweedfs.multipart_uploads(bucket, prefix) == []
    assert _keys(seaweedfs, bucket, prefix) == []


def test_destinations_only_under_granted_prefixes(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, artifact_store="s3://out/jobs",
                        artifact_destinations={"acme": ["s3://team-acme/models"]})
    allowed = check_destination("s3://team-acme/models/llama", "acme", settings)
    assert allowed == S3Location("team-acme", "models/llama")
    for tenant, destination in (("acme", "s3://team-acme/models-evil"),
                                ("acme", "s3://other/models"), ("bob", "s3://team-acme/models"),
                                (None, "s3://team-acme/models")):
        with pytest.raises(Forbidden):
            check_destination(destination, tenant, settings)
    with pytest.raises(InvalidRequest):
        check_destination("s3://team-acme/models/../x", "acme", settings)


def _io_bytes() -> int:
    """Bytes this process moved through read/write syscalls (sockets included)."""
    counters = dict(line.split(": ") for line in
                    Path("/proc/self/io").read_text().splitlines())
    return int(counters["rchar"]) + int(counters["wchar"])


def test_copyobject_s_limit_is_s3_s_5_gb_and_copy_parts_fit_s3_s_part_sizes() -> None:
    """The figures the copy below runs at a smaller scale: AWS's CopyObject takes at most 5 GB
    (decimal, its documentation's figure), and UploadPartCopy's ranges stay within its 5 MiB to
    5 GiB part sizes."""
    assert COPY_OBJECT_MAX_BYTES == 5 * 1000**3
    assert 5 * 1024**2 <= COPY_PART_BYTES <= 5 * 1024**3


def test_reuse_copies_an_object_beyond_copyobject_s_limit_in_parts_server_side(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3's CopyObject stops at 5 GB: a larger artifact is copied with UploadPartCopy ranges
    (the new object's ETag is a multipart one, ``-<parts>``), and no byte of it passes through
    this process. Run with the limit at 24 MiB and 8 MiB parts: the same requests against the
    real server as at 5 GB (SeaweedFS does not enforce AWS's limit), without uploading 5 GB
    first (78 s of the suite; bench-sized, not behaviour)."""
    from service.jobs import artifact_store
    from service.objectstore import multipart

    limit, part = 24 * 1024**2, 8 * 1024**2
    monkeypatch.setattr(artifact_store, "COPY_OBJECT_MAX_BYTES", limit)
    monkeypatch.setattr(multipart, "COPY_PART_BYTES", part)
    settings = _settings(tmp_path, seaweedfs, bucket, download_stall_seconds=600)
    store = ArtifactStore.configured(settings)
    assert store is not None
    staging = tmp_path / "staging"
    staging.mkdir()
    size = limit + 3 * 1024 * 1024
    big = staging / "model.gguf"
    with big.open("wb") as f:  # sparse: zeros but for a marked head and tail
        f.write(b"head" * 1024)
        f.seek(size - 4096)
        f.write(b"tail" * 1024)
    digests = {"model.gguf": sha256_file(big)}
    (staging / MANIFEST).write_text(json.dumps({"files": digests}))
    first = store.location_for("2" * 32, None)
    store.publish(staging, first, digests)
    big.unlink()

    second = store.location_for("3" * 32, None)
    before = _io_bytes()
    store.copy(first, second, ["model.gguf", MANIFEST])
    moved = _io_bytes() - before
    # requests, answers, a CA bundle read: kilobytes to a few MB, not the object's 27 MiB
    assert moved < 8 * 1024 * 1024, f"{moved} bytes went through this process"

    client = S3Store(bucket, endpoint=seaweedfs.endpoint, region="us-east-1",
                     access_key_id=seaweedfs.access_key, secret_access_key=seaweedfs.secret_key,
                     client_options={"allow_http": True})
    key = f"{second.prefix}/model.gguf"
    meta = obstore.head(client, key)
    parts = -(-size // part)
    assert parts == 4
    assert meta["size"] == size
    assert str(meta["e_tag"]).strip('"').endswith(f"-{parts}"), meta["e_tag"]
    head = bytes(obstore.get(client, key, options={"range": (0, 4096)}).bytes())
    tail = bytes(obstore.get(client, key, options={"range": (size - 4096, size)}).bytes())
    middle = bytes(obstore.get(client, key, options={
        "range": (part - 8, part + 8)}).bytes())
    assert head == b"head" * 1024 and tail == b"tail" * 1024 and middle == b"\0" * 16
    assert store.manifest(second) == {"files": digests}
    store.remove(first)
    store.remove(second)


def test_a_part_corrupted_after_hashing_is_refused_by_the_server_and_nothing_is_published(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    """One byte of a part's body flipped on the wire (after the client computed the part's
    SHA-256, before the server read it): the server refuses the part, the publication fails
    typed and leaves no manifest."""
    staging = tmp_path / "staging"
    digests = _staging(staging, {"a.bin": 1024, "b.bin": 40 * 1024 * 1024})
    with corrupting_proxy(seaweedfs.endpoint, offset=4 * 1024 * 1024) as proxy:
        settings = _settings(tmp_path, seaweedfs, bucket)
        store = ArtifactStore.configured(settings.model_copy(
            update={"s3_endpoint": proxy.endpoint}))
        assert store is not None
        location = store.location_for("4" * 32, None)
        with pytest.raises(ChecksumMismatch) as failed:
            store.publish(staging, location, digests)
        assert proxy.corrupted.is_set()
    assert failed.value.code == "checksum_mismatch"
    assert _keys(seaweedfs, bucket, location.prefix) == []
    # b.bin's multipart upload (its first part stored, the second refused) was aborted on the
    # server: no orphaned parts remain, listed or not.
    assert seaweedfs.multipart_uploads(bucket, location.prefix + "/") == []
