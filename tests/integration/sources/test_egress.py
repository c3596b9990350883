"""The egress policy against a real loopback server: refused destinations are never contacted."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.egress import EgressPolicy, egress_client
from service.errors import EgressRefused
from service.sources import SourceRequest, check_source, fetch_source
from service.stage import InMemoryContext
from tests.fixtures.http_server import FileServer, Route

BODY = b"weights" * 1000


def _settings(tmp_path: Path, allow: list[str]) -> Settings:
    return Settings(data_dir=tmp_path / "data", download_retries=0, egress_allowlist=allow)


def _ctx(settings: Settings) -> InMemoryContext:
    work = settings.data_dir / "jobs" / "job"
    work.mkdir(parents=True, exist_ok=True)
    return InMemoryContext(settings=settings, work_dir=work, job_id="job")


@pytest.mark.parametrize("host", [
    "169.254.169.254",     # cloud metadata service (link-local)
    "127.0.0.1", "[::1]",  # loopback
    "10.1.2.3", "192.168.0.1", "172.16.0.1",  # private
    "100.64.0.1",          # carrier-grade NAT (shared)
    "0.0.0.0", "[::ffff:127.0.0.1]", "[fe80::1]", "224.0.0.1",
])
def test_literal_non_global_hosts_are_refused_at_submission(tmp_path: Path, host: str) -> None:
    with pytest.raises(EgressRefused):
        check_source(SourceRequest(f"http://{host}/latest/model.safetensors"),
                     _settings(tmp_path, []))


def test_an_allowlisted_network_passes_the_submission_check(tmp_path: Path) -> None:
    check_source(SourceRequest("http://10.1.2.3/m/model.safetensors"),
                 _settings(tmp_path, ["10.0.0.0/8"]))


def test_a_host_name_resolving_to_loopback_is_refused_in_the_job_without_contact(
    http_server: FileServer, tmp_path: Path
) -> None:
    http_server.add("/model.safetensors", Route(body=BODY))
    port = http_server.base_url.rsplit(":", 1)[1]
    url = f"http://localhost:{port}/model.safetensors"
    settings = _settings(tmp_path, [])
    check_source(SourceRequest(url), settings)  # a name: only the job can resolve it
    with pytest.raises(EgressRefused, match="127.0.0.1"):
        fetch_source(SourceRequest(url), settings, _ctx(settings))
    assert http_server.seen == []


def test_an_allowlisted_host_name_is_fetched_with_its_own_host_header(
    http_server: FileServer, tmp_path: Path
) -> None:
    http_server.add("/model.safetensors", Route(body=BODY))
    port = http_server.base_url.rsplit(":", 1)[1]
    url = f"http://LocalHost:{port}/model.safetensors"
    settings = _settings(tmp_path, ["localhost"])
    sha = hashlib.sha256(BODY).hexdigest()
    resolved = fetch_source(SourceRequest(url, sha256=sha), settings, _ctx(settings))
    assert resolved.path.read_bytes() == BODY
    assert [s.headers.get("Host") for s in http_server.seen] == [f"localhost:{port}"]


def test_a_redirect_to_a_refused_address_is_not_followed(
    http_server: FileServer, tmp_path: Path
) -> None:
    port = http_server.base_url.rsplit(":", 1)[1]
    http_server.add("/inner/model.safetensors", Route(body=BODY))
    http_server.add("/model.safetensors", Route(status=302, headers={
        "Location": f"http://127.0.0.1:{port}/inner/model.safetensors"}))
    settings = _settings(tmp_path, ["localhost"])  # the name, not the loopback network
    with pytest.raises(EgressRefused):
        fetch_source(SourceRequest(f"http://localhost:{port}/model.safetensors"), settings,
                     _ctx(settings))
    assert [s.path for s in http_server.seen] == ["/model.safetensors"]


def test_the_checked_address_is_the_one_connected_to(http_server: FileServer) -> None:
    """DNS rebinding: a name that answers an allowed address, then a refused one, is resolved
    once per request and the request goes to the address that was checked."""
    answers = iter([["127.0.0.1"], ["169.254.169.254"], ["169.254.169.254"]])
    calls: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    http_server.add("/x", Route(body=b"ok"))
    port = http_server.base_url.rsplit(":", 1)[1]
    policy = EgressPolicy.from_allowlist(["127.0.0.1/32"], resolver=rebinding)
    with egress_client(policy, httpx.Timeout(5.0)) as client:
        assert client.get(f"http://rebind.example:{port}/x").content == b"ok"
        with pytest.raises(EgressRefused, match="169.254.169.254"):
            client.get(f"http://rebind.example:{port}/x")
    assert calls == ["rebind.example", "rebind.example"]
    assert len(http_server.seen) == 1
