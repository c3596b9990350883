"""A verification judged against the job's memory budget at submission, from the checkpoint's
safetensors headers: tract, which holds every weight, is refused naming the numbers; onnxruntime,
whose weights are memory-mapped, needs its own footprint whatever the model's size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.checkpoint.consistency import safetensors_weight_bytes
from service.config import Settings
from service.errors import VerificationTooLarge
from service.exporters.nnef.exporter import NNEFExporter, NNEFSpec
from service.exporters.onnx.verify import ORT_BASE_BYTES, ensure_ort_fits
from tests.fixtures.models import build_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama", "safetensors")


def test_the_weights_size_is_read_from_the_headers_alone(llama: Path) -> None:
    (shard,) = llama.glob("*.safetensors")
    header = int.from_bytes(shard.read_bytes()[:8], "little")
    assert safetensors_weight_bytes(llama) == shard.stat().st_size - 8 - header
    assert safetensors_weight_bytes(llama.parent) is None  # no safetensors there


def test_a_tract_verification_over_the_budget_is_refused_at_submission_with_numbers(
    llama: Path, tmp_path: Path
) -> None:
    config = json.loads((llama / "config.json").read_text())
    tight = Settings(data_dir=tmp_path, tract_max_memory="1MiB")
    with pytest.raises(VerificationTooLarge, match=r"GiB.*MODELPREP_TRACT_MAX_MEMORY"):
        NNEFExporter().check_files(NNEFSpec(), config, llama, tight)
    NNEFExporter().check_files(NNEFSpec(verify=False), config, llama, tight)  # nothing to hold
    NNEFExporter().check_files(NNEFSpec(), config, llama, Settings(data_dir=tmp_path))


def test_an_onnx_verification_needs_the_same_memory_at_any_model_size() -> None:
    for weight_bytes in (10**6, 10**10, 10**12):
        ensure_ort_fits(weight_bytes, str(ORT_BASE_BYTES))
    with pytest.raises(VerificationTooLarge):
        ensure_ort_fits(10**6, str(ORT_BASE_BYTES - 1))
