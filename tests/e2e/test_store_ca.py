"""An object store inside the network, signed by a private CA, trusted through ``AWS_CA_BUNDLE``.

A real SeaweedFS serves S3 over HTTPS only, with a certificate from a private CA (``trustme``).
A real ``modelprep serve``, configured as the AWS CLI would be (``AWS_ENDPOINT_URL_S3`` and
``AWS_CA_BUNDLE`` alone, no ``MODELPREP_*`` variable of the store, no general CA bundle), reads an
``s3://`` source and publishes the job's artifacts to the bucket; the hub keeps the public roots.
The same service without ``AWS_CA_BUNDLE`` fails both the read and the publication typed, naming
the variables that would make it trust the store, and publishes nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import trustme
from obstore.store import S3Store

from tests.fixtures.models import build_checkpoint
from tests.fixtures.seaweedfs import S3Server, start_seaweedfs, stop_seaweedfs
from tests.fixtures.service import ServiceProcess, running_service

EXPORTS = [{"format": "safetensors", "dtype": "bfloat16"}]
CA_VARIABLES = "MODELPREP_S3_CA_BUNDLE, AWS_CA_BUNDLE, MODELPREP_CA_BUNDLE"


@pytest.fixture(scope="module")
def tls_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS serving S3 over HTTPS with a private CA's certificate (its own server: the
    session's plain-HTTP one stays as the other tests expect it)."""
    proc, server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs-tls"), tls=trustme.CA())
    try:
        yield server
    finally:
        stop_seaweedfs(proc)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        tmp_path_factory.mktemp("models") / "llama", "llama", "safetensors", seed=5
    )


def _store(server: S3Server, bucket: str) -> S3Store:
    """A client of the bucket that trusts the private CA (the test's own view of the store)."""
    assert server.ca_bundle is not None
    store: S3Store = server.store(bucket)
    return store


@pytest.fixture(scope="module")
def bucket(tls_store: S3Server, checkpoint: Path) -> str:
    """A bucket holding the checkpoint under ``llama/``."""
    name = f"ca-{uuid.uuid4().hex[:10]}"
    tls_store.create_bucket(name)
    for path in sorted(checkpoint.iterdir()):
        obstore.put(_store(tls_store, name), f"llama/{path.name}", path)
    return name


def _env(server: S3Server, bucket: str, ca_bundle: str) -> dict[str, str]:
    """The AWS CLI's configuration of the store and nothing else: "" is unset, so this
    machine's own CA variables cannot stand in for the one under test."""
    return {
        "AWS_ENDPOINT_URL_S3": server.endpoint,
        "AWS_ENDPOINT_URL": "",
        "AWS_PROFILE": "",
        "AWS_CA_BUNDLE": ca_bundle,
        "SSL_CERT_FILE": "",
        "REQUESTS_CA_BUNDLE": "",
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_SESSION_TOKEN": "",
        "AWS_WEB_IDENTITY_TOKEN_FILE": "",
        "AWS_REGION": "us-east-1",
        "MODELPREP_ARTIFACT_STORE": f"s3://{bucket}/jobs",
        "MODELPREP_DOWNLOAD_RETRIES": "1",
        "MODELPREP_DOWNLOAD_BACKOFF_SECONDS": "0.05",
    }


def _run(service: ServiceProcess, source: str) -> dict[str, Any]:
    with service.client() as client:
        response = client.post("/v1/jobs", json={"source": source, "exports": EXPORTS})
    assert response.status_code == 202, response.text
    return service.wait_for(response.json()["id"], timeout=180)


def _keys(server: S3Server, bucket: str, prefix: str) -> list[str]:
    return sorted(
        meta["path"] for batch in obstore.list(_store(server, bucket), prefix) for meta in batch
    )


def test_aws_ca_bundle_alone_lets_the_service_read_and_publish_to_a_private_ca_store(
    tls_store: S3Server,
    bucket: str,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    assert tls_store.endpoint.startswith("https://") and tls_store.ca_bundle is not None
    env = _env(tls_store, bucket, str(tls_store.ca_bundle))
    with running_service(tmp_path / "trusting", [checkpoint.parent], env=env) as service:
        with service.client() as client:
            outbound = client.get("/readyz").json()["outbound"]
        assert outbound["s3_ca_bundle"] == {
            "value": str(tls_store.ca_bundle),
            "source": "AWS_CA_BUNDLE",
        }
        assert outbound["ca_bundle"] == {"value": "certifi", "source": "default"}  # the hub's

        job = _run(service, f"s3://{bucket}/llama")
        assert job["status"] == "succeeded", job["error"]
        prefix = f"jobs/_/{job['id']}"
        assert job["artifact_store"]["uri"] == f"s3://{bucket}/{prefix}"
        manifest = json.loads(
            bytes(obstore.get(_store(tls_store, bucket), f"{prefix}/manifest.json").bytes())
        )
        published = _keys(tls_store, bucket, prefix)
        assert {f"{prefix}/{entry['path']}" for entry in manifest["files"]} < set(published)
        assert any(key.endswith(".safetensors") for key in published)

        local = _run(service, checkpoint.as_uri())  # the publication alone meets the store
        assert local["status"] == "succeeded", local["error"]


def test_without_aws_ca_bundle_reads_and_publications_fail_typed_naming_the_ca_variables(
    tls_store: S3Server,
    bucket: str,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    env = _env(tls_store, bucket, "")
    with running_service(tmp_path / "untrusting", [checkpoint.parent], env=env) as service:
        read = _run(service, f"s3://{bucket}/llama")
        published = _run(service, checkpoint.as_uri())
    for job in (read, published):
        assert job["status"] == "failed"
        error = job["error"]
        assert tls_store.endpoint in error["message"] and "UnknownIssuer" in error["message"]
        assert CA_VARIABLES in error["message"], error["message"]
    # reading and publishing alike: the type says what to change (the CA setting)
    assert read["error"]["type"] == "certificate_untrusted", read["error"]
    assert published["error"]["type"] == "certificate_untrusted", published["error"]
    assert _keys(tls_store, bucket, f"jobs/_/{published['id']}") == []
