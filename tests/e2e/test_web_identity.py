"""A Kubernetes-style deployment end to end: ``modelprep serve`` holding no key, only a service
account's token file and a role (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``), against a
real STS (SeaweedFS's AssumeRoleWithWebIdentity trusting an OIDC issuer on loopback).

A real checkpoint is read from ``s3://`` and its export published to the bucket with the
temporary keys; the API's presigned download carries their session token. Once the token file
holds a token signed by another key, the next job fails ``access_denied``, naming the role,
never the token.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store

from tests.fixtures.models import build_checkpoint
from tests.fixtures.oidc import (  # noqa: F401  (fixture)
    ROLE_ARN,
    SigningKey,
    WebIdentityStore,
    web_identity_store,
)
from tests.fixtures.seaweedfs import S3Server
from tests.fixtures.service import running_service


def _setup_client(server: S3Server, bucket: str) -> S3Store:
    """The test's own view of the bucket (its key pair), to seed and check it."""
    store: S3Store = server.store(bucket)
    return store


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The service processes inherit this environment: no key pair anywhere in it."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


@pytest.mark.timeout(300)
def test_a_service_with_only_a_token_file_and_a_role_reads_and_publishes_through_sts(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
) -> None:
    server, issuer = web_identity_store.server, web_identity_store.issuer
    bucket = f"wi-e2e-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    root = tmp_path / "models"
    build_checkpoint(root / "llama", "llama", "safetensors")
    setup = _setup_client(server, bucket)
    for path in sorted((root / "llama").iterdir()):
        obstore.put(setup, f"src/{path.name}", path)

    token_file = tmp_path / "token"
    token_file.write_text(issuer.token())
    env = {
        "MODELPREP_ARTIFACT_STORE": f"s3://{bucket}/jobs",
        "MODELPREP_S3_ENDPOINT": server.endpoint,
        "MODELPREP_EGRESS_ALLOWLIST": '["127.0.0.1"]',
        "MODELPREP_DOWNLOAD_RETRIES": "1",
        "AWS_WEB_IDENTITY_TOKEN_FILE": str(token_file),
        "AWS_ROLE_ARN": ROLE_ARN,
    }
    body = {"source": f"s3://{bucket}/src", "exports": [{"format": "safetensors"}]}

    with running_service(tmp_path / "api", [], env=env) as api:
        with api.client() as client:
            response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        done = api.wait_for(response.json()["id"], timeout=240)
        assert done["status"] == "succeeded", done["error"]
        prefix = f"jobs/_/{done['id']}"
        assert done["metrics"]["bytes_downloaded"] > 0
        manifest = json.loads(bytes(obstore.get(setup, f"{prefix}/manifest.json").bytes()))
        listed = {f["path"]: f["sha256"] for f in manifest["files"]}
        weights = next(a for a in done["artifacts"] if a["path"].endswith(".safetensors"))
        with api.client(follow_redirects=True) as client:
            via_api = client.get(weights["url"])
        assert via_api.status_code == 200, via_api.text
        assert "X-Amz-Security-Token" in str(via_api.url)  # signed with the temporary keys
        assert hashlib.sha256(via_api.content).hexdigest() == listed[weights["path"]]

        # Each job runs in a process of its own, which reads the token file afresh: now a
        # token signed by another key under the issuer's key id.
        forged = issuer.token(key=SigningKey.generate(tmp_path, "forger"))
        token_file.write_text(forged)
        with api.client() as client:
            response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        failed = api.wait_for(response.json()["id"], timeout=240)
    assert failed["status"] == "failed", failed
    assert failed["error"]["type"].endswith("access_denied"), failed["error"]
    assert ROLE_ARN in failed["error"]["message"], failed["error"]
    assert "signature is invalid" in failed["error"]["message"], failed["error"]
    assert forged not in json.dumps(failed) and forged.split(".")[2] not in json.dumps(failed)
    logs = api.logs()
    assert forged.split(".")[2] not in logs and issuer.token().split(".")[1] not in logs
