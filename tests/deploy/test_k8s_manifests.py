"""deploy/k8s validated offline against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: an unknown field is an error), and checked for what the deployment promises: one shared
ReadWriteMany volume, keys from a Secret, the API behind its Service, workers probed by their
heartbeat, everything as uid 1000, no PostgreSQL of our own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# the oldest and newest Kubernetes minor versions the manifests are checked against
VERSIONS = ("1.29", "1.34")


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_kubernetes(version: str) -> None:
    docs = documents()
    assert {d["kind"] for d in docs} == {
        "Deployment", "Service", "PersistentVolumeClaim", "Secret"
    }
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_an_invalid_manifest_is_caught() -> None:
    broken = by_kind("Deployment")["modelprep-worker"]
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def pod(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind("Deployment")[name]["spec"]["template"]["spec"]
    return spec


def test_api_and_workers_share_one_read_write_many_volume_at_data() -> None:
    (claim,) = by_kind("PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for name in ("modelprep-api", "modelprep-worker"):
        spec = pod(name)
        (volume,) = spec["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        (container,) = spec["containers"]
        assert {"name": volume["name"], "mountPath": "/data"} in container["volumeMounts"]
        assert {"name": "MODELPREP_DATA_DIR", "value": "/data"} in container["env"]


def test_keys_and_database_come_from_the_secret_and_no_postgres_is_deployed() -> None:
    (secret,) = by_kind("Secret").values()
    assert {"MODELPREP_API_KEYS", "MODELPREP_DATABASE_URL"} <= set(secret["stringData"])
    for name in ("modelprep-api", "modelprep-worker"):
        (container,) = pod(name)["containers"]
        assert {"secretRef": {"name": secret["metadata"]["name"]}} in container["envFrom"]
        assert {"name": "MODELPREP_EXECUTOR", "value": "procrastinate"} in container["env"]
    images = {c["image"] for name in by_kind("Deployment") for c in pod(name)["containers"]}
    assert not any("postgres" in image for image in images)


def test_service_selects_the_api_pods_on_its_named_port() -> None:
    (service,) = by_kind("Service").values()
    labels = by_kind("Deployment")["modelprep-api"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod("modelprep-api")["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_workers_are_probed_by_their_heartbeat_file_and_run_as_uid_1000() -> None:
    (container,) = pod("modelprep-worker")["containers"]
    health_file = container["command"][container["command"].index("--health-file") + 1]
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"][:2] == ["modelprep", "healthcheck"]
        assert health_file in container[probe]["exec"]["command"]
    for name in ("modelprep-api", "modelprep-worker"):
        security = pod(name)["securityContext"]
        assert (security["runAsUser"], security["fsGroup"]) == (1000, 1000)


OBJECT_STORE = K8S / "object-store"


def object_store_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(OBJECT_STORE.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize("version", VERSIONS)
def test_the_object_store_variant_is_valid_kubernetes(version: str) -> None:
    docs = object_store_documents()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "ServiceAccount"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_object_store_variant_shares_no_volume_and_publishes_to_the_bucket() -> None:
    deployments = {d["metadata"]["name"]: d for d in object_store_documents()
                   if d["kind"] == "Deployment"}
    assert set(deployments) == {"modelprep-api", "modelprep-worker"}
    for deployment in deployments.values():
        spec = deployment["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == "modelprep"  # web identity for the bucket
        (volume,) = spec["volumes"]
        assert "emptyDir" in volume and "persistentVolumeClaim" not in volume
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["MODELPREP_ARTIFACT_STORE"].startswith("s3://")
        assert env["MODELPREP_EXECUTOR"] == "procrastinate"
