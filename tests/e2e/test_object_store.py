"""Object storage end to end: a real ``modelprep serve`` and two procrastinate workers that share
only PostgreSQL and a real S3 server (SeaweedFS on loopback): no directory in common.

Real SmolLM2 (its first 2 layers) is read from ``s3://``, exported to GGUF and safetensors,
published to the bucket (manifest last, model card beside it), downloaded through the API (a
redirect to a presigned URL) and directly from the bucket, every sha256 checked against the
manifest. An identical second job reuses the result with server-side copies (no byte through
a worker); DELETE and retention remove the objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import obstore
import pytest
from gguf import GGUFReader
from obstore.store import S3Store

from service.client import ModelprepClient
from tests.fixtures.models import build_checkpoint
from tests.fixtures.postgres import fresh_database
from tests.fixtures.real_models import COVERING_VARIANTS, real_variant
from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)
from tests.fixtures.service import ServiceProcess, running_service, running_worker
from tests.fixtures.waiting import eventually

pytestmark = pytest.mark.postgres

VARIANT = replace(COVERING_VARIANTS[0], layers=2)


@dataclass
class Cluster:
    api: ServiceProcess
    data_dirs: list[Path]
    server: S3Server
    bucket: str

    def client(self) -> httpx.Client:
        return self.api.client(follow_redirects=True)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.api.client() as client:
            response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        job: dict[str, Any] = response.json()
        return job

    def keys(self, prefix: str) -> list[str]:
        store = _client(self.server, self.bucket)
        return sorted(str(m["path"]) for batch in obstore.list(store, prefix) for m in batch)


def _client(server: S3Server, bucket: str) -> S3Store:
    return S3Store(bucket, endpoint=server.endpoint, region="us-east-1",
                   access_key_id=server.access_key, secret_access_key=server.secret_key,
                   client_options={"allow_http": True})


@contextmanager
def cluster(
    tmp_path: Path, server: S3Server, bucket: str, workers: int = 2, **extra: str,
) -> Iterator[Cluster]:
    """API and workers, each with a data directory of its own."""
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database())
        env = {
            "MODELPREP_EXECUTOR": "procrastinate",
            "MODELPREP_WORKERS": "1",
            "MODELPREP_WORKER_POLL_SECONDS": "0.5",
            "MODELPREP_DATABASE_URL": url,
            "MODELPREP_ARTIFACT_STORE": f"s3://{bucket}/jobs",
            "MODELPREP_S3_ENDPOINT": server.endpoint,
            "MODELPREP_EGRESS_ALLOWLIST": '["127.0.0.1"]',
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            **extra,
        }
        api_dir = tmp_path / "api"
        api = stack.enter_context(running_service(api_dir, [], env=env))
        dirs = [api_dir]
        for i in range(workers):
            data = tmp_path / f"worker-{i}"
            stack.enter_context(running_worker(data, url, [], env=env, name=f"worker-{i}"))
            dirs.append(data)
        yield Cluster(api, dirs, server, bucket)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_variant("smollm2", VARIANT)


def _upload(server: S3Server, bucket: str, prefix: str, directory: Path) -> None:
    store = _client(server, bucket)
    for path in sorted(directory.iterdir()):
        if path.is_file():
            obstore.put(store, f"{prefix}/{path.name}", path)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.timeout(900)
def test_smollm2_from_s3_published_to_the_bucket_reused_and_deleted_without_shared_disk(
    tmp_path: Path, seaweedfs: S3Server, smollm2: Path,  # noqa: F811
) -> None:
    seaweedfs.create_bucket("e2e-models")
    seaweedfs.create_bucket("e2e-artifacts")
    _upload(seaweedfs, "e2e-models", "smollm2", smollm2)
    body = {"source": "s3://e2e-models/smollm2",
            "exports": [{"format": "gguf", "type": "f16"}, {"format": "safetensors"}]}
    with cluster(tmp_path, seaweedfs, "e2e-artifacts") as c:
        with c.api.client() as client:
            escaping = client.post("/v1/jobs", json={**body, "source": "s3://e2e-models/a/../b"})
        assert escaping.status_code == 422, escaping.text

        first = c.api.wait_for(c.submit(body)["id"], timeout=800)
        assert first["status"] == "succeeded", first["error"]
        prefix = f"jobs/_/{first['id']}"
        assert first["artifact_store"]["uri"] == f"s3://e2e-artifacts/{prefix}"
        assert first["source"]["digest"] and first["metrics"]["bytes_published"] > 0
        names = sorted(a["path"] for a in first["artifacts"])
        assert "README.md" in names and "manifest.json" in names
        assert any(n.endswith(".gguf") for n in names)
        assert c.keys(prefix) == sorted(f"{prefix}/{n}" for n in names)
        # No worker (nor the API) keeps artifacts: the bucket is the only copy.
        for data in c.data_dirs:
            assert not list((data / "jobs").glob("*/artifacts")), data

        store = _client(seaweedfs, "e2e-artifacts")
        manifest = json.loads(bytes(obstore.get(store, f"{prefix}/manifest.json").bytes()))
        listed = {f["path"]: f["sha256"] for f in manifest["files"]}
        with c.client() as client:
            for artifact in first["artifacts"]:
                via_api = client.get(artifact["url"])
                assert via_api.status_code == 200, artifact
                assert via_api.history and via_api.history[0].status_code == 307
                direct = bytes(obstore.get(store, f"{prefix}/{artifact['path']}").bytes())
                assert _sha256(via_api.content) == _sha256(direct) == artifact["sha256"]
                if artifact["path"] != "manifest.json":
                    assert listed[artifact["path"]] == artifact["sha256"]
        gguf_name = next(n for n in names if n.endswith(".gguf"))
        local_gguf = tmp_path / "model.gguf"
        local_gguf.write_bytes(bytes(obstore.get(store, f"{prefix}/{gguf_name}").bytes()))
        fields = GGUFReader(local_gguf).fields

        def text(key: str) -> str:
            field = fields[key]
            return bytes(field.parts[field.data[0]]).decode()

        assert text("general.quantized_by") == "modelprep"
        assert text("general.source.url") == "s3://e2e-models/smollm2"
        assert '"type":"f16"' in text("general.description")
        assert first["source"]["digest"] in text("general.description")
        card = bytes(obstore.get(store, f"{prefix}/README.md").bytes()).decode()
        assert card.startswith("---\n") and 'library_name: "gguf"' in card
        assert first["source"]["digest"] in card

        second = c.api.wait_for(c.submit(body)["id"], timeout=300)
        assert second["status"] == "succeeded", second["error"]
        assert second["reused_from"] == first["id"]
        assert second["metrics"].get("bytes_downloaded", 0) == 0
        assert "bytes_published" not in second["metrics"]
        assert second["metrics"]["reused_bytes_copied"] == 0
        second_prefix = f"jobs/_/{second['id']}"
        assert c.keys(second_prefix) == sorted(f"{second_prefix}/{n}" for n in names)

        with ModelprepClient(c.api.url) as api_client:  # the CLI's client follows the redirect
            files = api_client.download(second, tmp_path / "cli")
        assert sorted(p.relative_to(tmp_path / "cli").as_posix() for p in files) == names

        with c.api.client() as client:
            assert client.delete(f"/v1/jobs/{first['id']}").status_code == 200
            gone = client.get(f"/v1/jobs/{first['id']}/artifacts/manifest.json")
            assert gone.status_code == 410
        assert c.keys(prefix) == []
        with c.client() as client:  # the reusing job owns its own objects
            kept = client.get(f"/v1/jobs/{second['id']}/artifacts/manifest.json")
            assert kept.status_code == 200 and _sha256(kept.content) == listed.get(
                "manifest.json", _sha256(kept.content))


@pytest.mark.timeout(300)
def test_retention_removes_the_objects_of_expired_jobs(
    tmp_path: Path, seaweedfs: S3Server, smollm2: Path,  # noqa: F811
) -> None:
    seaweedfs.create_bucket("e2e-ttl")
    _upload(seaweedfs, "e2e-ttl", "src", smollm2)
    with cluster(tmp_path, seaweedfs, "e2e-ttl", workers=1, MODELPREP_ARTIFACT_TTL="10",
                 MODELPREP_RETENTION_INTERVAL_SECONDS="0.5") as c:
        job = c.submit({"source": "s3://e2e-ttl/src", "exports": [{"format": "safetensors"}]})
        done = c.api.wait_for(job["id"], timeout=240)
        assert done["status"] == "succeeded", done["error"]
        prefix = f"jobs/_/{done['id']}"
        assert f"{prefix}/manifest.json" in c.keys(prefix)
        eventually(lambda: c.keys(prefix) == [], what="the expired job's objects removed",
                   timeout=60, context=c.api.logs)


def test_the_service_aborts_orphaned_multipart_uploads_under_its_store_at_start(
    tmp_path: Path, seaweedfs: S3Server,  # noqa: F811
) -> None:
    """An upload left in progress under the store (a publish that failed while the store was
    down, never retried) is aborted by the API's housekeeping once older than the bound; one
    outside the store's prefix is not the service's to touch."""
    seaweedfs.create_bucket("e2e-orphans")
    orphan, outside = f"jobs/_/{'8' * 32}/model.safetensors", "other/model.safetensors"
    for key in (orphan, outside):
        status, body = seaweedfs.request("POST", f"/e2e-orphans/{key}", query={"uploads": ""})
        assert status == 200, (status, body)
    assert seaweedfs.multipart_uploads("e2e-orphans", "") == sorted([orphan, outside])
    time.sleep(2.0)  # Initiated has whole seconds: the orphan is now older than 1 s
    with cluster(tmp_path, seaweedfs, "e2e-orphans", workers=0,
                 MODELPREP_ARTIFACT_UPLOAD_ORPHAN_AFTER="1") as c:
        eventually(lambda: seaweedfs.multipart_uploads("e2e-orphans", "jobs/") == [],
                   what="the orphaned upload aborted", timeout=60, context=c.api.logs)
    assert seaweedfs.multipart_uploads("e2e-orphans", "") == [outside]


@pytest.mark.timeout(300)
def test_object_server_stopped_during_publication_fails_the_job_typed_with_no_manifest(
    tmp_path: Path, seaweedfs: S3Server,  # noqa: F811
) -> None:
    """The source is local, so the job runs while the S3 server is stopped (SIGSTOP: it
    accepts connections and never answers) and fails only when it publishes."""
    root = tmp_path / "models"
    build_checkpoint(root / "llama", "llama", "safetensors")
    seaweedfs.create_bucket("e2e-stopped")
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database())
        env = {
            "MODELPREP_EXECUTOR": "procrastinate",
            "MODELPREP_WORKER_POLL_SECONDS": "0.5",
            "MODELPREP_DATABASE_URL": url,
            "MODELPREP_ARTIFACT_STORE": "s3://e2e-stopped/jobs",
            "MODELPREP_S3_ENDPOINT": seaweedfs.endpoint,
            "MODELPREP_DOWNLOAD_STALL_SECONDS": "3",
            "MODELPREP_DOWNLOAD_RETRIES": "1",
            "MODELPREP_DOWNLOAD_BACKOFF_SECONDS": "0.1",
            "AWS_ACCESS_KEY_ID": seaweedfs.access_key,
            "AWS_SECRET_ACCESS_KEY": seaweedfs.secret_key,
        }
        api = stack.enter_context(running_service(tmp_path / "api", [root], env=env))
        stack.enter_context(running_worker(tmp_path / "worker", url, [root], env=env))
        os.kill(seaweedfs.pid, signal.SIGSTOP)
        try:
            with api.client() as client:
                response = client.post("/v1/jobs", json={
                    "source": (root / "llama").as_uri(), "exports": [{"format": "safetensors"}]})
            assert response.status_code == 202, response.text
            done = api.wait_for(response.json()["id"], timeout=240)
        finally:
            os.kill(seaweedfs.pid, signal.SIGCONT)
        assert done["status"] == "failed"
        assert done["error"]["type"].endswith("publish_failed"), done["error"]
        keys = Cluster(api, [], seaweedfs, "e2e-stopped").keys(f"jobs/_/{done['id']}")
        assert f"jobs/_/{done['id']}/manifest.json" not in keys


@pytest.mark.timeout(300)
def test_wrong_credentials_fail_the_source_and_the_publication_access_denied(
    tmp_path: Path, seaweedfs: S3Server,  # noqa: F811
) -> None:
    """The service's key pair is refused by the store: a job reading s3:// fails at its
    download, a job from a local checkpoint at its publication, both ``access_denied``, and
    nothing is published."""
    root = tmp_path / "models"
    build_checkpoint(root / "llama", "llama", "safetensors")
    seaweedfs.create_bucket("e2e-denied")
    _upload(seaweedfs, "e2e-denied", "src", root / "llama")
    env = {
        "MODELPREP_ARTIFACT_STORE": "s3://e2e-denied/jobs",
        "MODELPREP_S3_ENDPOINT": seaweedfs.endpoint,
        "MODELPREP_EGRESS_ALLOWLIST": '["127.0.0.1"]',
        "MODELPREP_DOWNLOAD_RETRIES": "1",
        "AWS_ACCESS_KEY_ID": seaweedfs.access_key,
        "AWS_SECRET_ACCESS_KEY": "not-the-secret-0123456789",
    }
    with running_service(tmp_path / "api", [root], env=env) as api:
        failed = {}
        for label, source in (("source", "s3://e2e-denied/src"),
                              ("publication", (root / "llama").as_uri())):
            with api.client() as client:
                response = client.post("/v1/jobs", json={
                    "source": source, "exports": [{"format": "safetensors"}]})
            assert response.status_code == 202, response.text
            failed[label] = api.wait_for(response.json()["id"], timeout=240)
    for label, done in failed.items():
        assert done["status"] == "failed", (label, done)
        assert done["error"]["type"].endswith("access_denied"), (label, done["error"])
        assert "not-the-secret" not in json.dumps(done)
    assert failed["source"]["phase"] != "publishing"
    keys = Cluster(api, [], seaweedfs, "e2e-denied").keys("jobs/")
    assert keys == [], keys


@pytest.mark.timeout(300)
def test_a_job_publishes_under_a_granted_destination_and_any_other_is_refused(
    tmp_path: Path, seaweedfs: S3Server,  # noqa: F811
) -> None:
    """``"destination"`` through the API: under a prefix granted to the tenant (open mode's
    ``_`` here) the job's files and manifest go to ``<destination>/<job id>/`` instead of the
    store's root; a prefix that only starts like the granted one, another bucket, or a path
    climbing out are refused at submission, with no job."""
    root = tmp_path / "models"
    build_checkpoint(root / "llama", "llama", "safetensors")
    seaweedfs.create_bucket("e2e-dest")
    env = {
        "MODELPREP_ARTIFACT_STORE": "s3://e2e-dest/jobs",
        "MODELPREP_ARTIFACT_DESTINATIONS": '{"_": ["s3://e2e-dest/granted"]}',
        "MODELPREP_S3_ENDPOINT": seaweedfs.endpoint,
        "AWS_ACCESS_KEY_ID": seaweedfs.access_key,
        "AWS_SECRET_ACCESS_KEY": seaweedfs.secret_key,
    }
    body = {"source": (root / "llama").as_uri(), "exports": [{"format": "safetensors"}]}
    with running_service(tmp_path / "api", [root], env=env) as api:
        with api.client() as client:
            for refused, status in (("s3://e2e-dest/granted-evil/x", 403),
                                    ("s3://other-bucket/granted", 403),
                                    ("s3://e2e-dest/granted/../jobs", 422)):
                response = client.post("/v1/jobs", json={**body, "destination": refused})
                assert response.status_code == status, (refused, response.text)
            assert client.get("/v1/jobs").json()["items"] == []
            response = client.post("/v1/jobs", json={**body,
                                                     "destination": "s3://e2e-dest/granted/team"})
            assert response.status_code == 202, response.text
        done = api.wait_for(response.json()["id"], timeout=240)
    assert done["status"] == "succeeded", done["error"]
    prefix = f"granted/team/{done['id']}"
    assert done["artifact_store"]["uri"] == f"s3://e2e-dest/{prefix}"
    keys = Cluster(api, [], seaweedfs, "e2e-dest").keys("")
    assert f"{prefix}/manifest.json" in keys
    assert sorted(k for k in keys if k.startswith(prefix + "/")) == sorted(
        f"{prefix}/{a['path']}" for a in done["artifacts"])
    assert not any(k.startswith("jobs/") for k in keys)
