"""A local checkpoint quantized in a way the readers do not implement is refused at submission
(422 naming the method): nothing queued, no job directory. One whose quantization_config its
float tensors contradict is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.api.errors import http_status
from service.config import Settings
from service.errors import UnsupportedQuantization
from service.jobs.executors.local import LocalExecutor
from service.jobs.service import JobService
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore
from tests.fixtures.quantized import (
    AWQ_CONFIG,
    BNB_CONFIG,
    GPTQ_CONFIG,
    bnb4_tensors,
    gptq_tensors,
    with_quantization_config,
)


def _submit(base: Settings, store: JobStore, checkpoint: Path, fmt: str = "safetensors") -> None:
    settings = base.model_copy(update={"local_roots": [checkpoint.parent]})
    jobs = JobService(settings=settings, store=store, executor=LocalExecutor(settings, store))
    spec = JobSpec.model_validate(
        {"source": f"file://{checkpoint}", "exports": [{"format": fmt}]}
    )
    jobs.submit(spec)


@pytest.mark.parametrize(
    ("config", "tensors", "method"),
    [
        (GPTQ_CONFIG, gptq_tensors(), "gptq"),
        (AWQ_CONFIG, gptq_tensors(), "awq"),
        (BNB_CONFIG, bnb4_tensors(), "bitsandbytes"),
    ],
    ids=["gptq", "awq", "bitsandbytes"],
)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf", "nnef", "onnx"])
def test_an_unsupported_quantization_is_refused_at_submission_naming_the_method(
    base: Settings, store: JobStore, llama_safetensors_dir: Path, tmp_path: Path,
    config: dict[str, object], tensors: dict[str, torch.Tensor], method: str, fmt: str,
) -> None:  # fmt: skip
    ckpt = with_quantization_config(llama_safetensors_dir, tmp_path / "src" / method, config, tensors)
    with pytest.raises(UnsupportedQuantization) as refused:
        _submit(base, store, ckpt, fmt)
    assert refused.value.method == method and repr(method) in refused.value.message
    assert http_status(refused.value) == 422
    assert store.next_queued(10) == []
    assert not base.jobs_dir.exists() or not any(base.jobs_dir.iterdir())


@pytest.mark.parametrize("fmt", ["safetensors", "nnef", "onnx"])  # GGUF: the real-model test
def test_a_stale_quantization_config_over_float_weights_is_accepted_by_every_format(
    base: Settings, store: JobStore, llama_safetensors_dir: Path, tmp_path: Path, fmt: str
) -> None:
    ckpt = with_quantization_config(llama_safetensors_dir, tmp_path / "src" / "g", {"quant_method": "gguf"})
    _submit(base, store, ckpt, fmt)
    assert len(store.next_queued(10)) == 1
