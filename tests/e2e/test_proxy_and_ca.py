"""A service behind a corporate network's forward proxy and private CA, through a real service.

``modelprep serve`` runs with ``HTTP_PROXY`` / ``HTTPS_PROXY`` naming a real forward proxy on
loopback (tests/fixtures/forward_proxy.py) and ``SSL_CERT_FILE`` naming a private CA's bundle
(``trustme``): an olah hub mirror and a plain HTTP source download through the proxy, a TLS
source whose certificate that CA signed downloads through its CONNECT tunnel, one signed by
another private CA fails ``certificate_untrusted`` naming the variables, and a redirect to an
address the egress policy refuses fails ``egress_refused`` without the proxy ever being asked.
"""

from __future__ import annotations

import ssl
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.fixtures.forward_proxy import ForwardProxy, forward_proxy  # noqa: F401  (fixture)
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.models import build_checkpoint
from tests.fixtures.service import ServiceProcess, running_service

EXPORTS = [{"format": "safetensors", "dtype": "bfloat16"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "safetensors", seed=4)


def _tls_server(ca: trustme.CA) -> FileServer:
    """An https:// file server on 127.0.0.1 whose certificate ``ca`` signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return FileServer(tls=context)


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[trustme.CA, Path]:
    ca = trustme.CA()
    bundle = tmp_path_factory.mktemp("ca") / "corporate-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return ca, bundle


def _service(
    data: Path, proxy: ForwardProxy, hub: LocalHub, bundle: Path,
) -> AbstractContextManager[ServiceProcess]:
    """A service whose every connection goes through the proxy (no ``NO_PROXY``) and whose
    trust store is the private CA's bundle, named by ``SSL_CERT_FILE`` alone."""
    env = {
        # the service reads these case-insensitively, as curl does: one spelling each
        "HTTP_PROXY": proxy.url, "HTTPS_PROXY": proxy.url, "NO_PROXY": "", "MODELPREP_PROXY": "",
        "SSL_CERT_FILE": str(bundle), "REQUESTS_CA_BUNDLE": "",
        "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "",
        # the loopback servers the jobs use, and nothing else of loopback
        "MODELPREP_EGRESS_ALLOWLIST": '["127.0.0.1"]',
        "MODELPREP_DOWNLOAD_RETRIES": "1", "MODELPREP_DOWNLOAD_BACKOFF_SECONDS": "0.05",
    }
    return running_service(data, env=env)


def _run(service: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    with service.client() as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return service.wait_for(response.json()["id"], timeout=180)


def _host_port(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def test_downloads_go_through_the_proxy_and_trust_the_private_ca(
    tmp_path: Path, forward_proxy: ForwardProxy, local_hub: LocalHub,  # noqa: F811
    checkpoint: Path, private_ca: tuple[trustme.CA, Path],
) -> None:
    ca, bundle = private_ca
    weights = (checkpoint / "model.safetensors").read_bytes()
    plain = FileServer()
    tls = _tls_server(ca)
    other = _tls_server(trustme.CA())  # a private CA the service was not told of
    try:
        plain_url = plain.add("/plain/model.safetensors", Route(body=weights))
        tls_url = tls.add("/tls/model.safetensors", Route(body=weights))
        other_url = other.add("/other/model.safetensors", Route(body=weights))
        port = _host_port(plain.base_url).rpartition(":")[2]
        refused = plain.add("/moved/model.safetensors", Route(status=302, headers={
            "Location": f"http://127.0.0.2:{port}/plain/model.safetensors"}))
        repo = f"org/proxied-{uuid.uuid4().hex[:8]}"
        local_hub.create_repo(repo, files_of(checkpoint))
        with _service(tmp_path / "data", forward_proxy, local_hub, bundle) as service:
            with service.client() as client:
                outbound = client.get("/readyz").json()["outbound"]
            assert outbound["https_proxy"] == {"value": forward_proxy.url,
                                               "source": "HTTPS_PROXY"}
            assert outbound["ca_bundle"] == {"value": str(bundle), "source": "SSL_CERT_FILE"}

            hub_job = _run(service, {"source": f"hf://{repo}", "exports": EXPORTS})
            assert hub_job["status"] == "succeeded", hub_job["error"]
            assert forward_proxy.asked_for(_host_port(local_hub.endpoint))  # GET http://...

            plain_job = _run(service, {"source": plain_url, "exports": EXPORTS})
            assert plain_job["status"] == "succeeded", plain_job["error"]
            assert f"GET {plain_url}" in forward_proxy.targets

            tls_job = _run(service, {"source": tls_url, "exports": EXPORTS})
            assert tls_job["status"] == "succeeded", tls_job["error"]
            assert f"CONNECT {_host_port(tls_url)}" in forward_proxy.targets
            assert len(tls.downloads("/tls/model.safetensors")) == 1

            untrusted = _run(service, {"source": other_url, "exports": EXPORTS})
            assert untrusted["status"] == "failed"
            assert untrusted["error"]["type"] == "certificate_untrusted", untrusted["error"]
            message = untrusted["error"]["message"]
            assert str(bundle) in message and "SSL_CERT_FILE" in message
            assert "MODELPREP_CA_BUNDLE" in message
            assert other.downloads("/other/model.safetensors") == []

            before = forward_proxy.targets
            moved = _run(service, {"source": refused, "exports": EXPORTS})
            assert moved["status"] == "failed"
            assert moved["error"]["type"] == "egress_refused", moved["error"]
            assert "was not asked" in moved["error"]["message"]
            after = forward_proxy.targets[len(before):]
            assert set(after) == {f"GET {refused}"}, after  # the first hop only (header, body)
            assert not any("127.0.0.2" in target for target in forward_proxy.targets)
    finally:
        for server in (plain, tls, other):
            server.stop()
