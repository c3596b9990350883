"""The ONNX plan's int4/int8 terms, on headers alone: what each grows with (a slice of rows,
the largest quantized weight, the quantized sizes), never a whole model."""

from __future__ import annotations

from dataclasses import replace

from service.exporters import plan_export
from service.exporters.onnx.plan import (
    ONNX_PER_LAYER_BYTES,
    QUANTIZE_SLICE_BYTES,
    nbits_weight_bytes,
)
from service.exporters.onnx.quantize import NBits, quantized_bytes
from tests.unit.plan.test_plan import GiB, llama, spec


def test_int4_artifact_is_every_linear_quantized_and_the_rest_float() -> None:
    headers = llama(4, hidden=256, inter=512, vocab=1000)
    scheme = NBits(4, 32, True)
    linears = 4 * (4 * quantized_bytes(scheme, 256, 256, 4) + 3 * quantized_bytes(
        scheme, 512, 256, 4))  # fmt: skip
    head = quantized_bytes(scheme, 1000, 256, 4)
    floats = (1000 * 256 + 4 * 256) * 4  # the embedding and the norms
    assert nbits_weight_bytes(headers, scheme, 4) == linears + head + floats
    plan = plan_export(spec("onnx", weights="int4"), headers, GiB)
    assert plan.artifact_bytes == linears + head + floats
    assert all(c.mapped_bytes == plan.artifact_bytes for c in plan.children)
    float_plan = plan_export(spec("onnx"), headers, GiB)
    assert plan.artifact_bytes < float_plan.artifact_bytes / 3


def test_a_tied_head_is_one_quantized_copy_beside_the_float_embedding() -> None:
    untied = llama(2, hidden=256, inter=512, vocab=1000)
    without_head = tuple(t for t in untied.tensors if t.name != "lm_head.weight")
    config = {**(untied.config or {}), "tie_word_embeddings": True}
    tied = replace(untied, tensors=without_head, config=config)
    stored = replace(untied, config=config)  # tied, and the checkpoint stores the head too
    scheme = NBits(8, 128, False)
    expected = nbits_weight_bytes(untied, scheme, 4)
    assert nbits_weight_bytes(tied, scheme, 4) == expected
    assert nbits_weight_bytes(stored, scheme, 4) == expected


def test_quantizing_adds_a_slice_of_rows_whatever_the_model_and_the_check_one_weight() -> None:
    small, large = llama(3), llama(30)
    a, b = (plan_export(spec("onnx", weights="int4", verify=False), h, GiB) for h in (small, large))
    # no term grows with the weights (the graph grows with depth, as for float weights)...
    assert b.job_peak_rss_bytes - a.job_peak_rss_bytes == 27 * ONNX_PER_LAYER_BYTES
    float_plan = plan_export(spec("onnx", verify=False), small, GiB)
    export_phase = a.job_rss_during_children_bytes - float_plan.job_rss_during_children_bytes
    assert export_phase == QUANTIZE_SLICE_BYTES  # (the reference phase is another term)
    assert "a slice of rows quantized 192 MiB" in a.notes[0]
    # ... and the check dequantizes one weight at a time in float32: the largest (the head)
    checked = plan_export(spec("onnx", weights="int4"), small, GiB)
    assert "largest tensor 250 MiB" in checked.notes[0]  # float32 32000 x 2048: the same bytes
    assert checked.scratch_bytes == quantized_bytes(NBits(4, 32, True), 32000, 2048, 4) - (
        32000 * 64 * 16)  # fmt: skip  # its scales, spooled (packed blocks written directly)
    half = plan_export(spec("onnx", weights="int4", dtype="float16"), small, GiB)
    assert "largest quantized weight dequantized 375 MiB" in half.notes[0]  # float32 + its cast


def test_the_optimum_layout_plans_no_onnxruntime_genai_run() -> None:
    plan = plan_export(spec("onnx", layout="optimum"), llama(2), GiB)
    assert [c.name for c in plan.children] == ["onnxruntime"]
