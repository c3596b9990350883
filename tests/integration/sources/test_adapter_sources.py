"""A job's ``adapter`` from each kind of source, against real servers on loopback: an HTTP
server (``https://`` names the adapter's directory), SeaweedFS (``s3://``) and olah
(``hf://``). Each adapter is PEFT's own on a tiny Llama; each job merges it (safetensors, not
verified: the merge itself is pinned by tests/integration/real_models/test_lora.py) and the
exported weight must be the base's plus the adapter's ``scale * B @ A``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest
import torch
from obstore.store import S3Store
from safetensors import safe_open

from service.checkpoint.lora import ADAPTER_FILES
from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.pipeline import _identify, run_pipeline
from service.jobs.spec import JobSpec
from service.sources import SourceRequest
from service.sources.adapter import adapter_urls, check_adapter_source, fetch_adapter
from service.sources.cache import release_all
from service.stage import InMemoryContext
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.hub import LocalHub
from tests.fixtures.lora import peft_adapter
from tests.fixtures.models import build_checkpoint
from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)

WEIGHT = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "safetensors", seed=1)


@pytest.fixture(scope="module")
def adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peft_adapter(base, tmp_path_factory.mktemp("adapter") / "lora", r=4, lora_alpha=8)


def _tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name).float()


def _expected(base: Path, adapter: Path) -> torch.Tensor:
    key = f"base_model.model.{WEIGHT.removesuffix('.weight')}"
    a = _tensor(adapter / "adapter_model.safetensors", f"{key}.lora_A.weight")
    b = _tensor(adapter / "adapter_model.safetensors", f"{key}.lora_B.weight")
    return _tensor(base / "model.safetensors", WEIGHT) + (8 / 4) * (b @ a)


def _merged_job(settings: Settings, base: Path, uri: str) -> dict[str, object]:
    """Run a merging job of ``base`` with the adapter at ``uri``; its manifest, after checking
    the exported weight is the merge."""
    layout = JobLayout.for_job(settings, uuid.uuid4().hex)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=layout.work.parent.name)
    spec = JobSpec.model_validate({
        "source": base.as_uri(), "adapter": uri, "verify": False,
        "exports": [{"format": "safetensors"}],
    })  # fmt: skip
    run_pipeline(spec, ctx, layout)
    manifest: dict[str, object] = json.loads((layout.artifacts / "manifest.json").read_text())
    return manifest | {"weight": _tensor(layout.artifacts / "safetensors" / "model.safetensors",
                                         WEIGHT)}  # fmt: skip


def test_an_https_adapter_is_its_directorys_two_files_merged_by_the_job(
    http_server: FileServer, base: Path, adapter: Path, tmp_path: Path
) -> None:
    for name in ADAPTER_FILES:
        http_server.add(f"/loras/mine/{name}", Route(body=adapter / name))
    directory = http_server.url("/loras/mine/")
    assert adapter_urls(directory) == adapter_urls(http_server.url("/loras/mine/adapter_config.json"))
    settings = Settings(data_dir=tmp_path / "data", local_roots=[base.parent],
                        egress_allowlist=["127.0.0.0/8"], download_retries=1,
                        download_backoff_seconds=0.01)  # fmt: skip
    check_adapter_source(SourceRequest(directory), settings)
    manifest = _merged_job(settings, base, directory)
    torch.testing.assert_close(manifest["weight"], _expected(base, adapter), rtol=1e-2, atol=1e-3)
    assert manifest["source"]["adapter"]["uri"] == directory  # type: ignore[index]
    asked = sorted(s.path for s in http_server.seen)
    assert asked == ["/loras/mine/adapter_config.json", "/loras/mine/adapter_model.safetensors"]


def test_an_https_adapters_identity_is_its_bytes(
    http_server: FileServer, base: Path, adapter: Path, tmp_path: Path
) -> None:
    """Result reuse keys on what was downloaded: the same files under another URL are the
    same adapter, other bytes under the same URL another one."""
    settings = Settings(data_dir=tmp_path / "data", local_roots=[base.parent],
                        egress_allowlist=["127.0.0.0/8"])  # fmt: skip
    for prefix in ("/a", "/b"):
        for name in ADAPTER_FILES:
            http_server.add(f"{prefix}/{name}", Route(body=adapter / name))

    def key(prefix: str, job: str) -> str:
        ctx = InMemoryContext(settings=settings, work_dir=tmp_path / job, job_id=job)
        request = SourceRequest(http_server.url(f"{prefix}/"))
        assert _identify(SourceRequest(base.as_uri()), request, ctx)[0] is None  # not yet known
        fetched = fetch_adapter(request, settings, ctx)
        identity, _ = _identify(SourceRequest(base.as_uri()), request, ctx,
                                adapter_fetched=fetched)  # fmt: skip
        assert identity is not None
        return identity.key

    first = key("/a", "one")
    assert key("/b", "two") == first
    changed = (adapter / "adapter_config.json").read_bytes().replace(b'"r": 4', b'"r": 4 ')
    http_server.add("/b/adapter_config.json", Route(body=changed))
    assert key("/b", "three") != first


@pytest.fixture
def s3_settings(
    monkeypatch: pytest.MonkeyPatch, seaweedfs: S3Server, tmp_path: Path, base: Path  # noqa: F811
) -> Iterator[Settings]:
    for name in ("AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_SESSION_TOKEN",
                 "AWS_ENDPOINT", "AWS_ENDPOINT_URL"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    yield Settings(data_dir=tmp_path / "data", s3_endpoint=seaweedfs.endpoint,
                   local_roots=[base.parent], egress_allowlist=["127.0.0.1"],
                   download_retries=1, download_backoff_seconds=0.01)  # fmt: skip
    release_all()


def test_an_s3_adapter_prefix_is_fetched_and_merged_by_the_job(
    seaweedfs: S3Server, s3_settings: Settings, base: Path, adapter: Path  # noqa: F811
) -> None:
    bucket = f"lora-{uuid.uuid4().hex[:12]}"
    seaweedfs.create_bucket(bucket)
    store = S3Store(bucket, endpoint=seaweedfs.endpoint, region="us-east-1",
                    access_key_id=seaweedfs.access_key, secret_access_key=seaweedfs.secret_key,
                    client_options={"allow_http": True})  # fmt: skip
    for name in ADAPTER_FILES:
        obstore.put(store, f"adapters/mine/{name}", adapter / name)
    manifest = _merged_job(s3_settings, base, f"s3://{bucket}/adapters/mine/")
    torch.testing.assert_close(manifest["weight"], _expected(base, adapter), rtol=1e-2, atol=1e-3)
    assert manifest["source"]["adapter"]["revision"]  # type: ignore[index]  # the ETags' hash


def test_a_hub_adapter_repository_is_fetched_and_merged_by_the_job(
    local_hub: LocalHub, base: Path, adapter: Path, tmp_path: Path
) -> None:
    repo = f"loras/tiny-{uuid.uuid4().hex[:8]}"
    commit = local_hub.create_repo(repo, {name: adapter / name for name in ADAPTER_FILES})
    settings = Settings(data_dir=tmp_path / "data", hf_endpoint=local_hub.endpoint,
                        local_roots=[base.parent], download_retries=1,
                        download_backoff_seconds=0.01)  # fmt: skip
    manifest = _merged_job(settings, base, f"hf://{repo}")
    torch.testing.assert_close(manifest["weight"], _expected(base, adapter), rtol=1e-2, atol=1e-3)
    assert manifest["source"]["adapter"]["revision"] == commit  # type: ignore[index]


@pytest.mark.parametrize("merge", [True, False])
def test_a_remote_adapter_of_another_base_fails_the_job_naming_the_first_mismatch(
    http_server: FileServer, base: Path, tmp_path: Path, merge: bool
) -> None:
    """Its config is not read at submission (no network there): the job refuses it once
    fetched, before any export, merged or kept apart."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from service.errors import AdapterMismatch

    config = LlamaConfig.from_pretrained(base)
    config.update({"hidden_size": 2 * config.hidden_size})
    torch.manual_seed(0)
    other = peft_adapter(LlamaForCausalLM(config), tmp_path / "other")
    for name in ADAPTER_FILES:
        http_server.add(f"/other/{name}", Route(body=other / name))
    settings = Settings(data_dir=tmp_path / "data", local_roots=[base.parent],
                        egress_allowlist=["127.0.0.0/8"])  # fmt: skip
    layout = JobLayout.for_job(settings, "e" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="e" * 32)
    exports = [{"format": "safetensors"}] if merge else [{"format": "gguf", "lora": True}]
    spec = JobSpec.model_validate({
        "source": base.as_uri(), "adapter": http_server.url("/other/"), "merge": merge,
        "verify": False, "exports": exports,
    })  # fmt: skip
    with pytest.raises(AdapterMismatch, match="the adapter's 'model.layers.0.mlp.down_proj' is"):
        run_pipeline(spec, ctx, layout)
    assert not list(layout.staging.rglob("*.gguf")) and not list(layout.staging.rglob("*.safetensors"))
