"""s3:// sources against a real S3 server (SeaweedFS on loopback, tests/fixtures/seaweedfs.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store
from pydantic import SecretStr

from service.config import S3Credentials, Settings
from service.errors import (
    AccessDenied,
    ChecksumMismatch,
    DownloadTooLarge,
    EgressRefused,
    InvalidRequest,
    NoWeightFiles,
    ObjectNotFound,
    SourceUnreachable,
)
from service.sources import SourceRequest, check_source, fetch_source, identify_source
from service.sources.cache import release_all
from service.sources.local import LocalFetcher
from service.sources.s3 import S3Fetcher, cache_key
from service.stage import InMemoryContext
from tests.fixtures.models import build_checkpoint
from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def _standard_chain(monkeypatch: pytest.MonkeyPatch, seaweedfs: S3Server) -> Iterator[None]:  # noqa: F811
    """Jobs without a tenant key use the standard chain: here, the environment's keys."""
    for name in ("AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_SESSION_TOKEN",
                 "AWS_ENDPOINT", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    yield
    release_all()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "safetensors", seed=1)


@pytest.fixture
def bucket(seaweedfs: S3Server) -> str:  # noqa: F811
    name = f"src-{uuid.uuid4().hex[:12]}"
    seaweedfs.create_bucket(name)
    return name


def _client(server: S3Server, bucket: str) -> S3Store:
    return S3Store(bucket, endpoint=server.endpoint, region="us-east-1",
                   access_key_id=server.access_key, secret_access_key=server.secret_key,
                   client_options={"allow_http": True})


def _upload(server: S3Server, bucket: str, prefix: str, directory: Path) -> None:
    store = _client(server, bucket)
    for path in sorted(directory.iterdir()):
        obstore.put(store, f"{prefix}/{path.name}", path)


def _settings(tmp_path: Path, server: S3Server, **extra: object) -> Settings:
    return Settings(data_dir=tmp_path / "data", s3_endpoint=server.endpoint,
                    egress_allowlist=["127.0.0.1"], download_retries=1,
                    download_backoff_seconds=0.01, **extra)  # type: ignore[arg-type]


def _ctx(settings: Settings, name: str = "job") -> InMemoryContext:
    return InMemoryContext(settings=settings, work_dir=settings.data_dir / "jobs" / name)


def test_prefix_is_a_checkpoint_directory_of_one_format_cached_by_etags(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
) -> None:
    _upload(seaweedfs, bucket, "models/llama", llama)
    store = _client(seaweedfs, bucket)
    obstore.put(store, "models/llama/training_args.bin", b"not weights")
    obstore.put(store, "models/llama/deeper/model.safetensors", b"not part of it")
    obstore.put(store, "models/llama-evil/model.safetensors", b"a sibling prefix")
    settings = _settings(tmp_path, seaweedfs)
    request = SourceRequest(f"s3://{bucket}/models/llama/")
    check_source(request, settings)
    ctx = _ctx(settings)
    identity = identify_source(request, settings, ctx)
    assert identity is not None
    assert identity.key.startswith(f"s3:{seaweedfs.endpoint}/{bucket}/models/llama@")

    resolved = fetch_source(identity.request, settings, ctx)
    expected = sorted(p.name for p in llama.iterdir())
    assert sorted(p.name for p in resolved.path.iterdir()) == expected
    for name in expected:
        assert (resolved.path / name).read_bytes() == (llama / name).read_bytes(), name
    weights = (llama / "model.safetensors").stat().st_size
    assert resolved.bytes_downloaded >= weights and not resolved.cache_hit
    assert ctx.done == weights and ctx.total == weights
    assert ctx.details["source"]["format"] == "safetensors"
    assert resolved.revision == identity.request.pinned

    again = fetch_source(request, settings, _ctx(settings, "second"))
    assert again.cache_hit and again.bytes_downloaded == 0 and again.path == resolved.path
    # A new ETag is a new identity (a result computed from the old bytes is not reused).
    obstore.put(store, "models/llama/config.json", (llama / "config.json").read_bytes() + b" ")
    changed = identify_source(request, settings, _ctx(settings, "third"))
    assert changed is not None and changed.key != identity.key
    with pytest.raises(ChecksumMismatch, match="changed since the job resolved them"):
        fetch_source(identity.request, settings, _ctx(settings, "pinned"))


def test_single_object_source_brings_config_and_tokenizer_beside_it(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
) -> None:
    _upload(seaweedfs, bucket, "one", llama)
    settings = _settings(tmp_path, seaweedfs)
    resolved = fetch_source(SourceRequest(f"s3://{bucket}/one/model.safetensors"), settings,
                            _ctx(settings))
    assert resolved.path.name == "model.safetensors"
    assert resolved.path.read_bytes() == (llama / "model.safetensors").read_bytes()
    assert (resolved.path.parent / "config.json").exists()


def test_resumes_a_partial_read_with_a_ranged_get(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
) -> None:
    _upload(seaweedfs, bucket, "resume", llama)
    settings = _settings(tmp_path, seaweedfs)
    request = SourceRequest(f"s3://{bucket}/resume")
    identity = identify_source(request, settings, _ctx(settings))
    assert identity is not None and identity.request.pinned is not None
    # What an interrupted worker leaves: half the weights in the entry's part file.
    entries = settings.cache_dir / "entries"
    weights = (llama / "model.safetensors").read_bytes()
    half = len(weights) // 2
    files = entries / cache_key(settings, identity.request.pinned) / "files"
    files.mkdir(parents=True)
    (files / ".model.safetensors.part").write_bytes(weights[:half])
    resolved = fetch_source(identity.request, settings, _ctx(settings))
    assert (resolved.path / "model.safetensors").read_bytes() == weights
    aux = sum(p.stat().st_size for p in llama.iterdir() if p.name != "model.safetensors")
    assert resolved.bytes_downloaded == len(weights) - half + aux


def test_missing_bucket_prefix_or_object_is_object_not_found(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    settings = _settings(tmp_path, seaweedfs)
    for uri in (f"s3://{bucket}/nothing-here", f"s3://{bucket}/nothing/model.safetensors",
                "s3://no-such-bucket-0042/models"):
        with pytest.raises(ObjectNotFound):
            fetch_source(SourceRequest(uri), settings, _ctx(settings))


def test_wrong_credentials_are_access_denied_and_a_tenant_uses_its_own_key(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _upload(seaweedfs, bucket, "m", llama)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    settings = _settings(tmp_path, seaweedfs, s3_credentials={
        "acme": S3Credentials(access_key_id=seaweedfs.access_key,
                              secret_access_key=SecretStr(seaweedfs.secret_key)),
        "mallory": S3Credentials(access_key_id="mallory", secret_access_key=SecretStr("x" * 20)),
    })
    with pytest.raises(AccessDenied) as denied:
        fetch_source(SourceRequest(f"s3://{bucket}/m"), settings, _ctx(settings))
    assert denied.value.code == "access_denied"
    assert "not-the-secret" not in str(denied.value)
    with pytest.raises(AccessDenied):
        fetch_source(SourceRequest(f"s3://{bucket}/m", tenant="mallory"), settings,
                     _ctx(settings))
    resolved = fetch_source(SourceRequest(f"s3://{bucket}/m", tenant="acme"), settings,
                            _ctx(settings))
    assert (resolved.path / "model.safetensors").exists()


def test_no_key_escapes_its_prefix(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
) -> None:
    settings = _settings(tmp_path, seaweedfs)
    for uri in (f"s3://{bucket}/models/../secret", f"s3://{bucket}/a/./b",
                f"s3://{bucket}//x", f"s3://key:secret@{bucket}/x"):
        with pytest.raises(InvalidRequest):
            check_source(SourceRequest(uri), settings)
    # The server refuses such keys too; an index is the other way to name one.
    status, _ = seaweedfs.request("PUT", f"/{bucket}/models/x/../escaped.safetensors")
    assert status == 400
    store = _client(seaweedfs, bucket)
    obstore.put(store, "secret/model-00001-of-00001.safetensors",
                (llama / "model.safetensors").read_bytes())
    for name in ("config.json", "tokenizer.json"):
        if (llama / name).exists():
            obstore.put(store, f"evil/{name}", (llama / name).read_bytes())
    obstore.put(store, "evil/model-00001-of-00001.safetensors", b"decoy")
    index = {"metadata": {}, "weight_map": {"w": "../secret/model-00001-of-00001.safetensors"}}
    obstore.put(store, "evil/model.safetensors.index.json", json.dumps(index).encode())
    with pytest.raises(NoWeightFiles, match="names shards not in the repository"):
        fetch_source(SourceRequest(f"s3://{bucket}/evil"), settings, _ctx(settings))
    assert not list((settings.cache_dir / "entries").rglob("secret*"))


def test_size_limit_is_checked_before_the_first_byte(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
) -> None:
    _upload(seaweedfs, bucket, "big", llama)
    settings = _settings(tmp_path, seaweedfs, max_download_bytes=1000)
    ctx = _ctx(settings)
    with pytest.raises(DownloadTooLarge):
        fetch_source(SourceRequest(f"s3://{bucket}/big"), settings, ctx)
    assert ctx.metrics.get("bytes_downloaded", 0) == 0


def test_endpoint_obeys_the_egress_policy_and_a_dead_one_is_unreachable(
    tmp_path: Path, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    refused = Settings(data_dir=tmp_path / "data", s3_endpoint=seaweedfs.endpoint)
    with pytest.raises(EgressRefused):
        fetch_source(SourceRequest(f"s3://{bucket}/m"), refused, _ctx(refused))
    dead = Settings(data_dir=tmp_path / "data", s3_endpoint="http://127.0.0.1:9",
                    egress_allowlist=["127.0.0.1"], download_retries=1,
                    download_backoff_seconds=0.01)
    with pytest.raises(SourceUnreachable) as unreachable:
        fetch_source(SourceRequest(f"s3://{bucket}/m"), dead, _ctx(dead))
    assert unreachable.value.code == "source_unreachable"


def test_headers_describe_the_checkpoint_without_reading_weights(
    tmp_path: Path, seaweedfs: S3Server, bucket: str, llama: Path,  # noqa: F811
) -> None:
    _upload(seaweedfs, bucket, "hdr", llama)
    settings = _settings(tmp_path, seaweedfs, local_roots=[llama])
    remote = S3Fetcher().headers(SourceRequest(f"s3://{bucket}/hdr"), settings)
    local = LocalFetcher().headers(SourceRequest(llama.as_uri()), settings)
    assert remote.remote and remote.format == "safetensors"
    assert remote.tensors == local.tensors
    assert remote.config == local.config
    assert remote.files["model.safetensors"] == (llama / "model.safetensors").stat().st_size
