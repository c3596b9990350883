"""transformers' independent reference layer by layer, on real SmolLM2 (bf16, tied head).

Layer by layer, the embedding and the output head are never loaded: their rows come from the
memory-mapped safetensors file (a tied pair reads the one stored, under either name). What that computes must be
what transformers computes with the whole model loaded, within the agreement the job holds its
own model to in that mode.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import LlamaForCausalLM

from service.jobs.pipeline import REFERENCE_AGREEMENT
from service.verification.independent import independent_reference
from service.verification.logits import FIXED_TEXT, compare_logits
from service.verification.parity import relative_agreement
from service.verification.reference import fixed_input_ids
from tests.fixtures.real_models import real_model


def test_layer_by_layer_reads_embedding_and_head_from_the_file_and_agrees_with_whole(
    tmp_path: Path,
) -> None:
    source = real_model("smollm2")
    ids = fixed_input_ids(json.loads((source / "config.json").read_text())["vocab_size"])
    whole = independent_reference(source, LlamaForCausalLM, ids, FIXED_TEXT, 2**34, tmp_path / "w")
    layered = independent_reference(
        source, LlamaForCausalLM, ids, FIXED_TEXT, 64 << 20, tmp_path / "l"
    )
    assert (whole.mode, layered.mode) == ("whole", "layer-by-layer")
    assert layered.info["mapped_from_file"] == ["lm_head", "model.embed_tokens"], layered.info

    agreement = relative_agreement(
        whole.outputs, layered.outputs, REFERENCE_AGREEMENT["layer-by-layer"]
    )
    assert agreement["passed"], agreement
    # Both compute in float32 (accelerate casts each layer's bf16 weights as it loads them):
    # only the order of summation differs, not bfloat16's rounding through every layer.
    assert layered.info["compute_dtype"] == "float32"
    assert relative_agreement(whole.outputs, layered.outputs, 1e-4)["passed"]
    assert whole.chunks is not None
    figures = compare_logits(whole.chunk_logits(), layered.chunk_logits(), whole.chunks)
    assert figures.top1 == 1.0 and figures.kl_mean < 1e-6, figures


def test_layer_by_layer_reads_a_tie_stored_under_the_heads_name(tmp_path: Path) -> None:
    """A tied pair stored once as ``lm_head.weight`` (as the variants store it by default):
    layer by layer, the embedding reads the head's rows rather than staying on meta, which
    accelerate refused ("weight is on the meta device")."""
    from safetensors import safe_open

    from tests.fixtures.real_models import Variant, real_variant

    source = real_variant("smollm2", Variant(layers=2))
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    ids = fixed_input_ids(json.loads((source / "config.json").read_text())["vocab_size"])
    whole = independent_reference(source, LlamaForCausalLM, ids, FIXED_TEXT, 2**34, tmp_path / "w")
    layered = independent_reference(
        source, LlamaForCausalLM, ids, FIXED_TEXT, 64 << 20, tmp_path / "l"
    )
    assert layered.mode == "layer-by-layer"
    assert layered.info["mapped_from_file"] == ["lm_head", "model.embed_tokens"], layered.info
    assert relative_agreement(whole.outputs, layered.outputs, 1e-4)["passed"]


def test_the_whole_real_gemma3_job_model_agrees_with_transformers(tmp_path: Path) -> None:
    """The whole real Gemma 3 270M (bfloat16, 18 layers), verified safetensors: the job's model,
    built in float32, computes what transformers computes, within the whole mode's 1e-3. Its
    embed_scale built in float32 (25.298, not bfloat16's 25.25) had put it 0.0085 away, and every
    verified job of it that reads the job's model failed ``verification_failed``."""
    from tests.integration.real_models.test_consumers import run_job

    _, manifest = run_job(tmp_path, real_model("gemma3"), [{"format": "safetensors"}])
    reference = manifest["model"]["reference"]
    assert reference["mode"] == "whole"
    assert reference["job_model_agreement"]["max_rel_error"] < 1e-5, reference
