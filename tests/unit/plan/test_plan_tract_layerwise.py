"""How the plan (and the job, through the same function) picks tract's check of an NNEF archive:
whole when tract can hold the archive, block by block when it can hold the largest block only,
refused naming both needs when not even that fits. Headers alone, no torch, no tract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.checkpoint.headers import local_file_header
from service.config import Settings
from service.errors import VerificationTooLarge
from service.exporters import plan_export
from service.exporters.nnef import layerwise
from service.exporters.nnef.exporter import NNEFExporter, NNEFSpec
from service.exporters.nnef.plan import (
    MIN_VOCAB_CHUNK_BYTES,
    block_weight_bytes,
    tract_mode,
    tract_peaks,
)
from service.exporters.nnef.verify import ensure_tract_fits
from tests.fixtures.models import build_checkpoint
from tests.unit.plan.test_plan import GiB, llama, spec


def tract_limit(limit: int) -> Settings:
    """The service's settings with tract allowed ``limit`` bytes."""
    return Settings(tract_max_memory=str(limit))


def test_the_largest_block_is_one_layer_as_the_vocabulary_runs_in_chunks_of_a_layer() -> None:
    headers = llama(30, hidden=1024, inter=2816, vocab=32000, dtype="F16")
    layer = sum(t.nbytes for t in headers.tensors if t.name.startswith("model.layers.0."))
    embedding = 32000 * 1024 * 2
    assert embedding > layer > MIN_VOCAB_CHUNK_BYTES
    tensors = [(t.name, t.nbytes) for t in headers.tensors]
    assert block_weight_bytes(tensors) == layer
    # a small layer: the vocabulary's chunk is 16 MiB at least
    small = llama(2, hidden=256, inter=512, vocab=32000, dtype="F32")
    assert block_weight_bytes((t.name, t.nbytes) for t in small.tensors) == MIN_VOCAB_CHUNK_BYTES
    assert MIN_VOCAB_CHUNK_BYTES == layerwise.MIN_VOCAB_CHUNK_BYTES  # one figure: the check cuts what the plan counts


def test_nnef_plan_goes_block_by_block_when_the_archive_does_not_fit_tract() -> None:
    headers = llama(30, hidden=1024, inter=2816, dtype="F16")
    roomy = plan_export(spec("nnef"), headers, GiB, settings=tract_limit(64 * GiB))
    whole_need = roomy.children[0].peak_rss_bytes
    assert roomy.verification == "whole"

    tight = plan_export(spec("nnef"), headers, GiB, settings=tract_limit(whole_need - 1))
    assert tight.verification == "layerwise"
    (tract,) = tight.children
    # The block's peak is a fraction of the whole model's, and says so in the notes.
    assert tract.peak_rss_bytes < whole_need / 4
    assert "block by block" in tight.notes[0]

    # Unverified or compressed archives have no tract child at all.
    unverified = plan_export(spec("nnef", verify=False), headers, GiB, settings=tract_limit(1))
    assert unverified.children == ()


def test_tract_mode_is_whole_then_layerwise_then_none_as_the_limit_shrinks() -> None:
    archive, block = 4 * GiB, 200 << 20
    whole, layerwise = tract_peaks(archive, block)
    assert layerwise < whole
    assert tract_mode(archive, block, None) == "whole"
    assert tract_mode(archive, block, whole) == "whole"
    assert tract_mode(archive, block, whole - 1) == "layerwise"
    assert tract_mode(archive, block, layerwise) == "layerwise"
    assert tract_mode(archive, block, layerwise - 1) is None
    assert tract_mode(archive, None, whole - 1) is None  # an encoder is not cut


def test_a_check_that_fits_not_even_one_block_is_refused_naming_both_needs() -> None:
    archive, block = 4 * GiB, 200 << 20
    _, layerwise = tract_peaks(archive, block)
    assert ensure_tract_fits(archive, str(layerwise), block) == "layerwise"
    with pytest.raises(VerificationTooLarge) as refused:
        ensure_tract_fits(archive, str(layerwise - 1), block)
    message = str(refused.value)
    assert "GiB of RAM to run this model whole" in message
    assert "block by block (largest block 0.20 GiB" in message
    assert "MODELPREP_TRACT_MAX_MEMORY" in message
    with pytest.raises(VerificationTooLarge, match="cannot be checked block by block"):
        ensure_tract_fits(archive, str(layerwise), None)


def test_submission_accepts_a_budget_that_holds_one_block_and_refuses_one_that_does_not(
    tmp_path: Path,
) -> None:
    llama_dir = build_checkpoint(tmp_path / "llama", "llama", "safetensors")
    config = json.loads((llama_dir / "config.json").read_text())
    tensors = [t for f in llama_dir.glob("*.safetensors") for t in local_file_header(f)]
    weights = sum(t.nbytes for t in tensors)
    whole, layerwise = tract_peaks(weights, block_weight_bytes((t.name, t.nbytes) for t in tensors))
    assert layerwise < whole
    between = Settings(data_dir=tmp_path / "d", tract_max_memory=str(layerwise))
    NNEFExporter().check_files(NNEFSpec(), config, llama_dir, between)  # layer by layer
    below = Settings(data_dir=tmp_path / "d", tract_max_memory=str(layerwise - 1))
    with pytest.raises(VerificationTooLarge, match=r"whole and [0-9.]+ GiB block by block"):
        NNEFExporter().check_files(NNEFSpec(), config, llama_dir, below)


def test_a_per_expert_moe_plans_the_stack_its_experts_are_packed_into_as_its_largest_tensor() -> None:
    """transformers 5 packs a layer's per-expert tensors into stacks (gate and up into one),
    which the trace and torch-to-nnef's MoE extractor read whole: 8 experts x 5632 x 2048 in
    float32 is 369 MiB per projection, 738 MiB for gate_up, where one expert's is 46 MiB."""
    from service.exporters.nnef.plan import expert_stack_bytes

    moe, dense = llama(2, experts=8), llama(2)
    stack = 8 * 5632 * 2048 * 4
    assert expert_stack_bytes((t.name, t.numel * 4) for t in moe.tensors) == 2 * stack
    assert expert_stack_bytes((t.name, t.numel * 4) for t in dense.tensors) == 0
    moe_plan = plan_export(spec("nnef"), moe, GiB, verify=False)
    dense_plan = plan_export(spec("nnef"), dense, GiB, verify=False)
    block = 64 << 20  # the dense model's weights: a block at a time (MODELPREP_NNEF_BLOCK_BYTES)
    assert moe_plan.job_peak_rss_bytes - dense_plan.job_peak_rss_bytes == 2 * (2 * stack) - block
    assert f"({2 * stack >> 20} MiB float32)" in moe_plan.notes[0]


LLAMA_3_70B = {"hidden": 8192, "inter": 28672, "vocab": 128256}
LLAMA_3_1_405B = {"hidden": 16384, "inter": 53248, "vocab": 128256}


@pytest.mark.parametrize("widths", [LLAMA_3_70B, LLAMA_3_1_405B], ids=["70B", "405B"])
def test_tracts_block_term_is_the_block_setting_not_the_layer_at_70b_and_405b_widths(
    widths: dict[str, int],
) -> None:
    """One bfloat16 layer at Llama-3-70B's and Llama-3.1-405B's widths, in a 2.5 GiB service:
    whole-layer blocks (3.6 and 13 GiB of float32 weights) would be refused; below a layer,
    the largest block is the block setting and tract's term is 64 MiB + 2 x 256 MiB at
    either width, within the 640 MiB tract gets there (two workers)."""
    headers = llama(1, dtype="BF16", **widths)
    settings = Settings(memory_limit=int(2.5 * GiB))
    layer = block_weight_bytes((t.name, t.numel * 4) for t in headers.tensors)
    assert layer > 3 * GiB
    plan = plan_export(spec("nnef"), headers, GiB, settings=settings)
    assert plan.verification == "layerwise"
    (tract,) = plan.children
    assert tract.peak_rss_bytes == 64 * 2**20 + 2 * 256 * 2**20
    assert tract.peak_rss_bytes <= int(str(settings.tract_max_memory))
    assert "min(block setting 256 MiB, largest layer" in plan.notes[0]
    # whole layers, as before: more than the service's tract may hold
    assert tract_mode(1 << 40, layer, int(str(settings.tract_max_memory))) is None


def test_tracts_block_term_stays_flat_as_the_width_grows_past_the_block() -> None:
    """The plan's formula at two widths beyond the block, and one below it (a small layer is
    not cut: its block is the layer)."""
    settings = Settings(tract_block_bytes="64MiB", tract_max_memory=str(GiB))

    def tract_peak(hidden: int) -> int:
        headers = llama(2, hidden=hidden, inter=4 * hidden, vocab=32000)
        plan = plan_export(spec("nnef"), headers, GiB, settings=settings)
        assert plan.verification == "layerwise"
        return plan.children[0].peak_rss_bytes

    assert tract_peak(2048) == tract_peak(4096) == 64 * 2**20 + 2 * 64 * 2**20
    small = llama(2, hidden=256, inter=1024, vocab=32000)
    sizes = [(t.name, t.nbytes) for t in small.tensors]
    assert block_weight_bytes(sizes, 64 << 20) == block_weight_bytes(sizes) < 64 << 20
