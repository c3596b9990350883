"""The variables every other tool on a platform's machines reads, through a real service.

Two ``modelprep serve`` processes configured the way a platform team configures its other tools,
with no ``MODELPREP_*`` variable for the store or the hub: one reaches SeaweedFS (a real S3
server on loopback) through ``AWS_ENDPOINT_URL_S3`` alone and runs under ``HF_HUB_OFFLINE``; the
other reaches it through ``AWS_ENDPOINT_URL`` alone and an olah hub mirror through
``HF_ENDPOINT`` alone. ``/readyz`` names each endpoint and the variable it came from.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
from obstore.store import S3Store

from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.models import build_checkpoint
from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)
from tests.fixtures.service import ServiceProcess, running_service

EXPORTS = [{"format": "safetensors", "dtype": "bfloat16"}]
UNSET = {
    # "" is unset, as the AWS SDKs and huggingface_hub read it: nothing from this machine's
    # environment may stand in for the variable under test.
    "AWS_ENDPOINT_URL": "", "AWS_ENDPOINT_URL_S3": "", "AWS_PROFILE": "",
    "AWS_WEB_IDENTITY_TOKEN_FILE": "", "AWS_SESSION_TOKEN": "", "HF_ENDPOINT": "", "HF_TOKEN": "",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "safetensors", seed=3)


@pytest.fixture(scope="module")
def bucket(seaweedfs: S3Server, checkpoint: Path) -> str:  # noqa: F811
    """A bucket holding the checkpoint under ``llama/``."""
    name = f"std-{uuid.uuid4().hex[:10]}"
    seaweedfs.create_bucket(name)
    store = S3Store(name, endpoint=seaweedfs.endpoint, region="us-east-1",
                    access_key_id=seaweedfs.access_key, secret_access_key=seaweedfs.secret_key,
                    client_options={"allow_http": True})
    for path in sorted(checkpoint.iterdir()):
        obstore.put(store, f"llama/{path.name}", path)
    return name


def _env(server: S3Server, **variables: str) -> dict[str, str]:
    return {**UNSET, "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key, "AWS_REGION": "us-east-1",
            "MODELPREP_DOWNLOAD_RETRIES": "1", **variables}


@pytest.fixture(scope="module")
def endpoint_url_s3(
    seaweedfs: S3Server, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
) -> Iterator[ServiceProcess]:
    """Only ``AWS_ENDPOINT_URL_S3`` names the store; ``HF_HUB_OFFLINE=1``."""
    env = _env(seaweedfs, AWS_ENDPOINT_URL_S3=seaweedfs.endpoint, HF_HUB_OFFLINE="1")
    with running_service(tmp_path_factory.mktemp("s3only"), env=env) as service:
        yield service


@pytest.fixture(scope="module")
def endpoint_url(
    seaweedfs: S3Server, local_hub: LocalHub,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServiceProcess]:
    """Only ``AWS_ENDPOINT_URL`` names the store and only ``HF_ENDPOINT`` the hub."""
    env = _env(seaweedfs, AWS_ENDPOINT_URL=seaweedfs.endpoint, HF_ENDPOINT=local_hub.endpoint,
               HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
    with running_service(tmp_path_factory.mktemp("global"), env=env) as service:
        yield service


def _run(service: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    with service.client() as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return service.wait_for(response.json()["id"], timeout=180)


def _outbound(service: ServiceProcess) -> dict[str, dict[str, str]]:
    with service.client() as client:
        outbound: dict[str, dict[str, str]] = client.get("/readyz").json()["outbound"]
    return outbound


def test_the_store_is_reached_with_only_aws_endpoint_url_s3(
    endpoint_url_s3: ServiceProcess, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    job = _run(endpoint_url_s3, {"source": f"s3://{bucket}/llama", "exports": EXPORTS})
    assert job["status"] == "succeeded", job["error"]
    outbound = _outbound(endpoint_url_s3)
    assert outbound["s3_endpoint"] == {"value": seaweedfs.endpoint,
                                       "source": "AWS_ENDPOINT_URL_S3"}
    assert outbound["s3_region"] == {"value": "us-east-1", "source": "AWS_REGION"}
    assert outbound["hf_hub_offline"]["value"] == "true"
    assert outbound["s3_credentials"] == {"value": "environment keys",
                                          "source": "AWS_ACCESS_KEY_ID"}
    assert seaweedfs.secret_key not in str(outbound)
    assert seaweedfs.access_key not in str(outbound)


def test_hub_sources_are_refused_typed_under_hf_hub_offline(
    endpoint_url_s3: ServiceProcess,
) -> None:
    with endpoint_url_s3.client() as client:
        response = client.post("/v1/jobs", json={"source": "hf://org/any", "exports": EXPORTS})
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["type"].endswith("/source_not_allowed")
    assert "HF_HUB_OFFLINE" in problem["detail"]


def test_the_store_is_reached_with_only_aws_endpoint_url(
    endpoint_url: ServiceProcess, seaweedfs: S3Server, bucket: str,  # noqa: F811
) -> None:
    job = _run(endpoint_url, {"source": f"s3://{bucket}/llama", "exports": EXPORTS})
    assert job["status"] == "succeeded", job["error"]
    outbound = _outbound(endpoint_url)
    assert outbound["s3_endpoint"] == {"value": seaweedfs.endpoint, "source": "AWS_ENDPOINT_URL"}
    # AWS_ENDPOINT_URL is every service's endpoint in the SDKs: STS's too
    assert outbound["sts_endpoint"] == {"value": seaweedfs.endpoint,
                                        "source": "AWS_ENDPOINT_URL"}


def test_the_hub_mirror_is_reached_with_only_hf_endpoint(
    endpoint_url: ServiceProcess, local_hub: LocalHub, checkpoint: Path,
) -> None:
    repo = f"org/std-{uuid.uuid4().hex[:8]}"
    commit = local_hub.create_repo(repo, files_of(checkpoint))
    job = _run(endpoint_url, {"source": f"hf://{repo}", "exports": EXPORTS})
    assert job["status"] == "succeeded", job["error"]
    assert job["source"]["revision"] == commit
    assert local_hub.served("GET", f"/{repo}/resolve/") > 0
    assert _outbound(endpoint_url)["hf_endpoint"] == {"value": local_hub.endpoint,
                                                      "source": "HF_ENDPOINT"}
