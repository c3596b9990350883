"""The client's resumable download of an artifact the API serves by a redirect to a presigned
URL of a real S3 server (SeaweedFS): a resume names the ETag its ``.part`` was cut from, so an
object replaced meanwhile is downloaded again whole, never spliced onto the old bytes.

S3 servers ignore ``If-Range`` on GET (SeaweedFS answers 206 whatever it names; AWS does not
list it among GetObject's conditions) but honour ``If-Match``: the client sends both.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
from obstore.store import S3Store

from service.client import CHUNK, ModelprepClient
from tests.fixtures.http_server import FileServer, Route, http_server  # noqa: F401  (fixture)
from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)

SIZE = 4 * CHUNK


class Interrupted(Exception):
    """Stands for a client killed mid-download: raised from the progress callback."""


def _store(server: S3Server) -> S3Store:
    bucket = f"resume-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return S3Store(bucket, endpoint=server.endpoint, region="us-east-1",
                   access_key_id=server.access_key, secret_access_key=server.secret_key,
                   client_options={"allow_http": True})


def _artifact(server: FileServer, store: S3Store, data: bytes) -> dict[str, Any]:
    """The artifact as the API lists it: its URL answers 307 to a presigned GET (the API's
    route for a job in the artifact store)."""
    presigned = obstore.sign(store, "GET", "model.gguf", timedelta(minutes=10))
    url = server.add(f"/v1/jobs/j/artifacts/{uuid.uuid4().hex}",
                     Route(status=307, headers={"Location": presigned}))
    return {"path": "model.gguf", "size": len(data), "url": url,
            "sha256": hashlib.sha256(data).hexdigest()}


def _interrupted_download(client: ModelprepClient, artifact: dict[str, Any], out: Path) -> None:
    def stop_after_first_chunk(path: str, done: int, total: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        client.download({"status": "succeeded", "id": "j", "artifacts": [artifact]}, out,
                        on_progress=stop_after_first_chunk)


def test_a_resume_of_an_unchanged_object_fetches_only_the_rest(
    tmp_path: Path, seaweedfs: S3Server, http_server: FileServer,  # noqa: F811
) -> None:
    store = _store(seaweedfs)
    data = os.urandom(SIZE)
    obstore.put(store, "model.gguf", data)
    artifact = _artifact(http_server, store, data)
    out = tmp_path / "out"
    with ModelprepClient(http_server.base_url) as client:
        _interrupted_download(client, artifact, out)
        part = out / "model.gguf.part"
        assert part.stat().st_size == CHUNK
        assert (out / "model.gguf.part.etag").read_text() == obstore.head(store, "model.gguf")[
            "e_tag"]
        progress: list[int] = []
        client.download({"status": "succeeded", "id": "j", "artifacts": [artifact]}, out,
                        on_progress=lambda _p, done, _t: progress.append(done))
    assert (out / "model.gguf").read_bytes() == data
    assert progress[0] == 2 * CHUNK  # the first chunk of the resume lands after the .part
    assert not part.exists() and not (out / "model.gguf.part.etag").exists()


def test_an_object_replaced_since_the_part_was_cut_is_downloaded_again_not_spliced(
    tmp_path: Path, seaweedfs: S3Server, http_server: FileServer,  # noqa: F811
) -> None:
    store = _store(seaweedfs)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    obstore.put(store, "model.gguf", old)
    out = tmp_path / "out"
    with ModelprepClient(http_server.base_url) as client:
        _interrupted_download(client, _artifact(http_server, store, old), out)
        assert (out / "model.gguf.part").read_bytes() == old[:CHUNK]
        obstore.put(store, "model.gguf", new)  # same key, same size, other bytes
        progress: list[int] = []
        client.download({"status": "succeeded", "id": "j",
                         "artifacts": [_artifact(http_server, store, new)]}, out,
                        on_progress=lambda _p, done, _t: progress.append(done))
    assert (out / "model.gguf").read_bytes() == new
    assert progress[0] == CHUNK  # started over from byte 0
