"""A source described from its headers alone (``SourceFetcher.headers``), never its weights:
a local directory, an HTTP file (range reads cut off after the header) and a hub commit (olah,
which ignores ``Range``)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from huggingface_hub import hf_hub_download
from safetensors import safe_open

from service.checkpoint.headers import PROBE_BYTES, CheckpointHeaders, header_length
from service.config import Settings
from service.errors import CorruptCheckpoint
from service.sources import SourceRequest, fetcher_for
from service.sources.http import download_file
from service.stage import InMemoryContext
from tests.fixtures.http_server import HEADER_READ_RANGE, FileServer, Route
from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.models import build_checkpoint


@pytest.fixture(autouse=True)
def _hub_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    yield


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("sharded"), "llama", "safetensors-sharded")


def _expected(checkpoint: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    out = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    assert {v[0] for v in out.values()} <= set(names)
    return out


def _as_dict(headers: CheckpointHeaders) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.dtype, t.shape) for t in headers.tensors}


BIG_BYTES = 64 * 1024 * 1024
"""A file much larger than what loopback sockets buffer once a client stops reading."""


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64 MiB safetensors file of one float32 vector (sparse: the data are zeros)."""
    path = tmp_path_factory.mktemp("big") / "model.safetensors"
    n = (BIG_BYTES - 1024) // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    raw = header.encode().ljust(1016)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 4 * n)
    return path


def _header_end(path: Path) -> int:
    with path.open("rb") as f:
        return 8 + header_length(f.read(8), path.name)


def test_a_local_sharded_checkpoint_is_described_by_its_headers(
    sharded: Path, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "data", local_roots=[sharded.parent])
    request = SourceRequest(f"file://{sharded}")
    headers = fetcher_for(request.uri).headers(request, settings)
    assert headers.format == "safetensors" and not headers.remote
    assert _as_dict(headers) == _expected(sharded)
    assert headers.config is not None and headers.config["model_type"] == "llama"
    assert sorted(headers.weight_files) == sorted(p.name for p in sharded.glob("*.safetensors"))
    assert headers.weight_bytes == sum(t.nbytes for t in headers.tensors)
    assert headers.download_bytes == 0  # read in place
    assert headers.files["config.json"] == (sharded / "config.json").stat().st_size


def test_an_http_file_is_described_by_its_header_and_the_weights_are_never_read(
    http_server: FileServer, sharded: Path, tmp_path: Path
) -> None:
    shard = min(sharded.glob("*.safetensors"))
    # The server closes the connection right after the header: reading a byte of the
    # weights would fail the request.
    url = http_server.add(
        "/m/model.safetensors", Route(body=shard, cut_after=_header_end(shard), cuts=100)
    )
    settings = Settings(data_dir=tmp_path / "data", egress_allowlist=["127.0.0.0/8"])
    headers = fetcher_for(url).headers(SourceRequest(url), settings)
    with safe_open(shard, "pt") as f:
        assert {t.name for t in headers.tensors} == set(f.keys())
    assert headers.files == {"model.safetensors": shard.stat().st_size}
    assert headers.remote and headers.download_bytes == shard.stat().st_size
    assert headers.config is None
    (seen,) = [s for s in http_server.seen if s.path == "/m/model.safetensors"]
    assert seen.headers["Range"] == f"bytes=0-{PROBE_BYTES - 1}"


def test_an_http_file_cut_inside_its_header_is_a_corrupt_checkpoint(
    http_server: FileServer, sharded: Path, tmp_path: Path
) -> None:
    shard = min(sharded.glob("*.safetensors"))
    url = http_server.add("/m/short.safetensors", Route(body=shard.read_bytes()[:100]))
    settings = Settings(data_dir=tmp_path / "data", egress_allowlist=["127.0.0.0/8"])
    with pytest.raises(CorruptCheckpoint, match="short.safetensors"):
        fetcher_for(url).headers(SourceRequest(url), settings)


def test_a_hub_commit_is_described_by_its_listing_and_shard_headers(
    local_hub: LocalHub, sharded: Path, tmp_path: Path
) -> None:
    local_hub.create_repo("org/headers", {**files_of(sharded), "pytorch_model.bin": b"x" * 999})
    settings = Settings(data_dir=tmp_path / "data", hf_endpoint=local_hub.endpoint)
    headers = fetcher_for("hf://org/headers").headers(SourceRequest("hf://org/headers"), settings)
    assert _as_dict(headers) == _expected(sharded)
    assert headers.config is not None and headers.config["model_type"] == "llama"
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert sorted(headers.weight_files) == shards
    assert "pytorch_model.bin" not in headers.files  # the files a job would download, only
    assert headers.download_bytes == sum(
        (sharded / name).stat().st_size for name in headers.files
    )
    assert not (settings.data_dir / "cache").exists()  # nothing was downloaded


def test_a_header_read_from_a_server_that_ignores_range_hangs_up_after_the_header(
    http_server: FileServer, big: Path, tmp_path: Path
) -> None:
    url = http_server.add("/big/model.safetensors", Route(body=big, honor_range=False))
    settings = Settings(data_dir=tmp_path / "data", egress_allowlist=["127.0.0.0/8"])
    headers = fetcher_for(url).headers(SourceRequest(url), settings)
    assert [(t.name, t.dtype) for t in headers.tensors] == [("w", "F32")]
    assert headers.files == {"model.safetensors": BIG_BYTES}
    (seen,) = http_server.seen
    assert seen.range == HEADER_READ_RANGE
    # the whole file was offered (200); the client hung up, what left is socket buffers' worth
    assert seen.sent < BIG_BYTES // 4, f"a header read took {seen.sent} of {BIG_BYTES} bytes"
    print(f"\nFIGURE http header read, Range ignored: {seen.sent} of {BIG_BYTES} bytes sent")
    assert http_server.downloads("/big/model.safetensors") == []
    # the count can fail: two real downloads of the file are two
    for name in ("one", "two"):
        download_file(url, tmp_path / name, settings, InMemoryContext(settings, tmp_path))
    assert len(http_server.downloads("/big/model.safetensors")) == 2


def test_a_hub_header_read_is_no_download_and_hangs_up_after_the_header(
    local_hub: LocalHub, big: Path, tmp_path: Path
) -> None:
    local_hub.create_repo("org/big-header", {"model.safetensors": big, "config.json": b"{}"})
    settings = Settings(data_dir=tmp_path / "data", hf_endpoint=local_hub.endpoint)
    request = SourceRequest("hf://org/big-header")
    headers = fetcher_for(request.uri).headers(request, settings)
    assert [(t.name, t.dtype) for t in headers.tensors] == [("w", "F32")]
    (read,) = local_hub.served_requests("org/big-header", "resolve", "model.safetensors")
    assert read["method"] == "GET" and read["range"] == HEADER_READ_RANGE  # olah ignores it
    assert not read["complete"] and read["sent"] < BIG_BYTES // 4, read
    print(f"\nFIGURE hub header read (olah): {read['sent']} of {BIG_BYTES} bytes handed over")
    assert local_hub.downloads("org/big-header", "resolve", "model.safetensors") == []
    # the count can fail: two real downloads of the file (two caches) are two
    for cache in ("one", "two"):
        hf_hub_download("org/big-header", "model.safetensors", endpoint=local_hub.endpoint,
                        cache_dir=tmp_path / cache)
    assert len(local_hub.downloads("org/big-header", "resolve", "model.safetensors")) == 2
