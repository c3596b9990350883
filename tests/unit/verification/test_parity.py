"""Export verification: streamed source vs streamed export on a fixed input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import VerificationFailed
from service.exporters.safetensors.verify import reference_outputs, verify_safetensors_export
from service.stage import InMemoryContext
from service.verification.parity import Tolerance, compare_outputs, tolerance_for
from service.verification.reference import fixed_input_ids
from tests.fixtures.models import VOCAB_SIZE, Arch, build_tiny_model

TINY_BUDGET = "40KB"  # far below the tiny models' weights: most modules stream from disk


@pytest.fixture
def ctx(tmp_path: Path) -> InMemoryContext:
    return InMemoryContext(settings=Settings(data_dir=tmp_path / "var"), work_dir=tmp_path / "work")


def export_as(arch: Arch, dtype: torch.dtype, out: Path) -> Path:
    """What a safetensors exporter writes: the same weights, cast, via save_pretrained."""
    model = build_tiny_model(arch)
    torch.nn.Module.to(model, dtype)
    model.save_pretrained(str(out))
    return out


def test_reference_outputs_are_the_in_memory_models_outputs(
    llama_safetensors_dir: Path, ctx: InMemoryContext
) -> None:
    ids = fixed_input_ids(VOCAB_SIZE)
    with open_checkpoint(llama_safetensors_dir) as source:
        streamed = reference_outputs(source, ids, ctx.settings, ctx, max_memory=TINY_BUDGET)
    with torch.inference_mode():
        eager = build_tiny_model("llama")(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(streamed, eager.logits)
    assert not any((ctx.work_dir / "verify").iterdir())  # scratch stores are removed


def test_fixed_input_is_the_same_for_every_job() -> None:
    assert torch.equal(fixed_input_ids(VOCAB_SIZE), fixed_input_ids(VOCAB_SIZE))
    assert fixed_input_ids(VOCAB_SIZE).shape == (1, 8)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_float32_export_has_zero_error(
    tiny_checkpoint: object, ctx: InMemoryContext, tmp_path: Path, arch: Arch
) -> None:
    exported = export_as(arch, torch.float32, tmp_path / "export")
    with open_checkpoint(tiny_checkpoint(arch, "safetensors")) as source:  # type: ignore[operator]
        summary = verify_safetensors_export(
            source, exported, torch.float32, ctx, max_memory=TINY_BUDGET
        )
    assert summary["passed"] is True
    assert summary["max_abs_error"] == 0.0 and summary["max_rel_error"] == 0.0
    assert summary["export_run"]["placed"]["disk_ref"] > 0  # it really streamed from disk
    assert summary["export_run"]["reloads"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_export_passes_within_its_tolerance(
    llama_bin_dir: Path, ctx: InMemoryContext, tmp_path: Path, dtype: torch.dtype
) -> None:
    exported = export_as("llama", dtype, tmp_path / "export")
    with open_checkpoint(llama_bin_dir) as source:
        summary = verify_safetensors_export(source, exported, dtype, ctx, max_memory=TINY_BUDGET)
    assert 0 < summary["max_rel_error"] <= tolerance_for("torch", dtype).rtol
    assert summary["dtype"] == str(dtype).removeprefix("torch.")


def test_a_corrupted_export_fails_verification(
    llama_safetensors_dir: Path, ctx: InMemoryContext, tmp_path: Path
) -> None:
    exported = export_as("llama", torch.float32, tmp_path / "export")
    weights = load_file(exported / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name].flip(0).contiguous()  # rows swapped, as a buggy writer would
    save_file(weights, exported / "model.safetensors", metadata={"format": "pt"})
    with (
        open_checkpoint(llama_safetensors_dir) as source,
        pytest.raises(VerificationFailed, match="beyond tolerance"),
    ):
        verify_safetensors_export(source, exported, torch.float32, ctx, max_memory=TINY_BUDGET)
    assert not any((ctx.work_dir / "verify").iterdir())


def test_export_without_config_borrows_the_sources(
    llama_safetensors_dir: Path, ctx: InMemoryContext, tmp_path: Path
) -> None:
    exported = export_as("llama", torch.float32, tmp_path / "export")
    (exported / "config.json").unlink()
    with open_checkpoint(llama_safetensors_dir) as source:
        summary = verify_safetensors_export(source, exported, "float32", ctx)
    assert summary["max_abs_error"] == 0.0


def test_reference_can_be_shared_across_exports(
    llama_safetensors_dir: Path, ctx: InMemoryContext, tmp_path: Path
) -> None:
    ids = fixed_input_ids(VOCAB_SIZE)
    with open_checkpoint(llama_safetensors_dir) as source:
        reference = reference_outputs(source, ids, ctx.settings, ctx)
        for dtype in (torch.float32, torch.bfloat16):
            exported = export_as("llama", dtype, tmp_path / f"export-{dtype}")
            summary = verify_safetensors_export(source, exported, dtype, ctx, reference=reference)
            assert summary["passed"] is True


def test_compare_outputs_reports_shape_mismatch_and_non_finite_values() -> None:
    ref = np.ones((1, 4), dtype=np.float32)
    relative = Tolerance(0.0, 1e-5)
    assert compare_outputs([np.ones((1, 5), np.float32)], [ref], relative).passed is False
    nan = compare_outputs([np.array([[1.0, np.nan, 1.0, 1.0]], np.float32)], [ref], relative)
    assert nan.passed is False and nan.finite is False
    close = compare_outputs([ref + np.float32(2**-20)], [ref], relative)
    assert close.passed is True and close.max_abs_error == 2**-20
    far = compare_outputs([ref + np.float32(2**-10)], [ref], relative)
    assert far.passed is False and far.max_rel_error == 2**-10


def test_unknown_dtype_has_no_tolerance() -> None:
    with pytest.raises(VerificationFailed):
        tolerance_for("torch", torch.int8)
