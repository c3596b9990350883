"""A hub or S3 checkpoint quantized in a way the readers do not implement is refused at
submission (422 naming the method), as a local one is: its config.json and safetensors headers
are read with a few requests (olah as the hub, SeaweedFS as S3), nothing is queued, nothing is
downloaded, no job directory is made. A stale quantization_config over float weights is not
refused: the headers show the tensors contradict it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import obstore
import pytest
import torch
from obstore.store import S3Store

from service.api.errors import http_status
from service.config import Settings
from service.errors import UnsupportedQuantization
from service.jobs.executors.local import LocalExecutor
from service.jobs.service import JobService
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore
from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.quantized import (
    AWQ_CONFIG,
    BNB_CONFIG,
    GPTQ_CONFIG,
    bnb4_tensors,
    gptq_tensors,
    with_quantization_config,
)
from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)

METHODS = [
    pytest.param(GPTQ_CONFIG, gptq_tensors, "gptq", id="gptq"),
    pytest.param(AWQ_CONFIG, gptq_tensors, "awq", id="awq"),
    pytest.param(BNB_CONFIG, bnb4_tensors, "bitsandbytes", id="bitsandbytes"),
]


@pytest.fixture(autouse=True)
def _clients(monkeypatch: pytest.MonkeyPatch, seaweedfs: S3Server) -> Iterator[None]:  # noqa: F811
    """The hub client without xet; S3 with the server's keys as the standard chain."""
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    for name in ("AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_SESSION_TOKEN",
                 "AWS_ENDPOINT", "AWS_ENDPOINT_URL"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    yield


def _jobs(settings: Settings) -> tuple[JobService, JobStore]:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore.from_url(settings.sqlalchemy_url)
    store.create_schema()
    return JobService(settings=settings, store=store, executor=LocalExecutor(settings, store)), store


def _submit(settings: Settings, source: str) -> JobStore:
    jobs, store = _jobs(settings)
    jobs.submit(JobSpec.model_validate({"source": source, "exports": [{"format": "gguf"}]}))
    return store


def _assert_refused(settings: Settings, source: str, method: str) -> None:
    with pytest.raises(UnsupportedQuantization) as refused:
        _submit(settings, source)
    assert refused.value.method == method and repr(method) in refused.value.message
    assert http_status(refused.value) == 422
    store = JobStore.from_url(settings.sqlalchemy_url)
    assert store.next_queued(10) == []
    for where in (settings.jobs_dir, settings.cache_dir):  # no job directory, no download
        assert not where.exists() or not any(where.iterdir()), where


def _quantized(src: Path, out: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    return with_quantization_config(src, out, config, tensors)


def _hub_settings(tmp_path: Path, hub: LocalHub) -> Settings:
    return Settings(data_dir=tmp_path / "data", hf_endpoint=hub.endpoint, download_retries=1)


@pytest.mark.parametrize(("config", "tensors", "method"), METHODS)
def test_a_hub_checkpoint_quantized_unsupportedly_is_refused_at_submission(
    local_hub: LocalHub, llama_safetensors_dir: Path, tmp_path: Path,
    config: dict[str, object], tensors: object, method: str,
) -> None:  # fmt: skip
    ckpt = _quantized(llama_safetensors_dir, tmp_path / "src", config, tensors())  # type: ignore[operator]
    repo = f"org/{method}-{uuid.uuid4().hex[:8]}"
    local_hub.create_repo(repo, files_of(ckpt))
    _assert_refused(_hub_settings(tmp_path, local_hub), f"hf://{repo}", method)


def test_a_hub_checkpoint_with_a_stale_quantization_config_is_accepted(
    local_hub: LocalHub, llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    ckpt = with_quantization_config(llama_safetensors_dir, tmp_path / "src", {"quant_method": "gguf"})
    repo = f"org/stale-{uuid.uuid4().hex[:8]}"
    local_hub.create_repo(repo, files_of(ckpt))
    store = _submit(_hub_settings(tmp_path, local_hub), f"hf://{repo}")
    assert len(store.next_queued(10)) == 1


def _s3_settings(tmp_path: Path, server: S3Server) -> Settings:
    return Settings(data_dir=tmp_path / "data", s3_endpoint=server.endpoint,
                    egress_allowlist=["127.0.0.1"], download_retries=1,
                    download_backoff_seconds=0.01)  # fmt: skip


def _upload(server: S3Server, directory: Path) -> str:
    bucket = f"q-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    store = S3Store(bucket, endpoint=server.endpoint, region="us-east-1",
                    access_key_id=server.access_key, secret_access_key=server.secret_key,
                    client_options={"allow_http": True})  # fmt: skip
    for path in sorted(directory.iterdir()):
        obstore.put(store, f"model/{path.name}", path)
    return f"s3://{bucket}/model"


@pytest.mark.parametrize(("config", "tensors", "method"), METHODS)
def test_an_s3_checkpoint_quantized_unsupportedly_is_refused_at_submission(
    seaweedfs: S3Server, llama_safetensors_dir: Path, tmp_path: Path,  # noqa: F811
    config: dict[str, object], tensors: object, method: str,
) -> None:  # fmt: skip
    ckpt = _quantized(llama_safetensors_dir, tmp_path / "src", config, tensors())  # type: ignore[operator]
    _assert_refused(_s3_settings(tmp_path, seaweedfs), _upload(seaweedfs, ckpt), method)


def test_an_s3_checkpoint_with_a_stale_quantization_config_is_accepted(
    seaweedfs: S3Server, llama_safetensors_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    ckpt = with_quantization_config(llama_safetensors_dir, tmp_path / "src", {"quant_method": "gguf"})
    store = _submit(_s3_settings(tmp_path, seaweedfs), _upload(seaweedfs, ckpt))
    assert len(store.next_queued(10)) == 1


def test_an_s3_vlm_in_a_layout_transformers_cannot_load_is_refused_at_submission(
    seaweedfs: S3Server, tmp_path: Path  # noqa: F811
) -> None:
    """Not a quantization, but the same headers: a GGUF export judges a remote VLM's tensor
    names (``Exporter.check_headers``) before anything is queued or downloaded; the published
    layout of the same model is queued."""
    from safetensors.torch import load_file, save_file

    from service.errors import UnsupportedExport
    from tests.fixtures.vlm import write_tiny_qwen2vl

    published = write_tiny_qwen2vl(tmp_path / "published")
    settings = _s3_settings(tmp_path, seaweedfs)
    store = _submit(settings, _upload(seaweedfs, published))
    assert len(store.next_queued(10)) == 1
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for path in published.iterdir():
        if path.is_file():
            (renamed / path.name).write_bytes(path.read_bytes())
    weights = load_file(renamed / "model.safetensors")
    save_file({k.replace("visual.", "vision_encoder."): v for k, v in weights.items()},
              renamed / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    settings = _s3_settings(tmp_path / "again", seaweedfs)
    with pytest.raises(UnsupportedExport, match="layout transformers' own rules"):
        _submit(settings, _upload(seaweedfs, renamed))
    assert JobStore.from_url(settings.sqlalchemy_url).next_queued(10) == []
    assert not settings.cache_dir.exists() or not any(settings.cache_dir.iterdir())
