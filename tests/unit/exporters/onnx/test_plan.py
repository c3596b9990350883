"""The ONNX plan's terms, on headers alone: what each grows with (a block of a weight's rows
written, cast or dequantized; a slice of rows quantized; the quantized sizes; onnxruntime's
mapped weights apart from its anonymous memory), never a whole tensor or model."""

from __future__ import annotations

from dataclasses import replace

from service.checkpoint.headers import CheckpointHeaders
from service.exporters import plan_export
from service.exporters.onnx.plan import (
    ONNX_BASE_BYTES,
    ONNX_PER_LAYER_BYTES,
    ORT_BASE_BYTES,
    ORT_LOGITS_COPIES,
    QUANTIZE_SLICE_BYTES,
    WRITE_BLOCK_BYTES,
    WRITE_BLOCK_COPIES,
    nbits_weight_bytes,
)
from service.exporters.onnx.quantize import NBits, quantized_bytes
from service.plan.terms import JOB_BASE_BYTES, REFERENCE_CTX
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


def test_a_tied_head_at_int8_is_one_quantized_copy_beside_the_float_embedding() -> None:
    untied = llama(2, hidden=256, inter=512, vocab=1000)
    without_head = tuple(t for t in untied.tensors if t.name != "lm_head.weight")
    config = {**(untied.config or {}), "tie_word_embeddings": True}
    tied = replace(untied, tensors=without_head, config=config)
    stored = replace(untied, config=config)  # tied, and the checkpoint stores the head too
    scheme = NBits(8, 128, False)
    expected = nbits_weight_bytes(untied, scheme, 4)
    assert nbits_weight_bytes(tied, scheme, 4) == expected
    assert nbits_weight_bytes(stored, scheme, 4) == expected


def test_a_tied_head_at_int4_is_the_embedding_too_no_float_copy() -> None:
    untied = llama(2, hidden=256, inter=512, vocab=1000)
    without_head = tuple(t for t in untied.tensors if t.name != "lm_head.weight")
    config = {**(untied.config or {}), "tie_word_embeddings": True}
    tied = replace(untied, tensors=without_head, config=config)
    stored = replace(untied, config=config)
    scheme = NBits(4, 32, True)
    float_embedding = 1000 * 256 * 4
    expected = nbits_weight_bytes(untied, scheme, 4) - float_embedding
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
    # ... and the check dequantizes a block of a weight's rows at a time in float32, which
    # its first run compares with the source's rows (float32 throughout: 4 + 4 bytes a value)
    checked = plan_export(spec("onnx", weights="int4"), small, GiB)
    assert "a block of a quantized weight dequantized 128 MiB" in checked.notes[0]
    assert checked.scratch_bytes == quantized_bytes(NBits(4, 32, True), 32000, 2048, 4) - (
        32000 * 64 * 16)  # fmt: skip  # its scales, spooled (packed blocks written directly)
    half = plan_export(spec("onnx", weights="int4", dtype="float16"), small, GiB)
    # float16: the block, its cast, the source's rows read in float32 and cast (4+2+2+4)
    assert "a block of a quantized weight dequantized 192 MiB" in half.notes[0]
    unchecked = plan_export(spec("onnx", weights="int4", dtype="float16", verify=False), small, GiB)
    checking = half.job_rss_during_children_bytes - unchecked.job_rss_during_children_bytes
    assert checking == (192 - 128) * 2**20  # beyond the write's block (64 MiB read and cast)


def test_the_optimum_layout_plans_no_onnxruntime_genai_run() -> None:
    plan = plan_export(spec("onnx", layout="optimum"), llama(2), GiB)
    assert [c.name for c in plan.children] == ["onnxruntime"]


def _llama3(hidden: int, inter: int, layers: int = 1) -> CheckpointHeaders:
    """bfloat16 headers at Llama 3 widths (vocabulary 128256), with a tokenizer: the job
    checks the logits on the fixed text."""
    headers = llama(layers, hidden=hidden, inter=inter, vocab=128256, dtype="BF16")
    return replace(headers, files={**headers.files, "tokenizer.json": 1})


def test_the_jobs_weight_term_is_a_block_flat_past_it_at_70b_and_405b_widths() -> None:
    """No job term is a whole tensor: at Llama-3-70B widths the embedding is 4008 MiB in float32
    (the plan's former "largest tensor 4008 MiB x 2 (cast)"), at 405B widths twice that; the
    export's term is two blocks (read and cast) at both."""
    wide, wider = _llama3(8192, 28672), _llama3(16384, 53248)
    a, b = (plan_export(spec("onnx"), h, GiB, verify=False) for h in (wide, wider))
    block = WRITE_BLOCK_COPIES * WRITE_BLOCK_BYTES
    assert a.job_peak_rss_bytes == b.job_peak_rss_bytes
    assert a.job_peak_rss_bytes == JOB_BASE_BYTES + ONNX_BASE_BYTES + block + ONNX_PER_LAYER_BYTES
    assert "a block of the largest tensor 64 MiB x 2 (read and cast) (largest tensor 4008 MiB" in (
        a.notes[0])  # fmt: skip
    assert "(largest tensor 8016 MiB" in b.notes[0]
    # float32 from float32: the block is written as read, one copy
    same = plan_export(spec("onnx"), llama(1, 8192, 28672, 128256), GiB, verify=False)
    assert same.job_peak_rss_bytes == a.job_peak_rss_bytes - WRITE_BLOCK_BYTES


def test_below_the_block_the_weight_term_is_the_largest_tensor() -> None:
    small = llama(2, hidden=256, inter=512, vocab=1000, dtype="BF16")  # embedding 1000 KB in f32
    plan = plan_export(spec("onnx"), small, GiB, verify=False)
    largest = 1000 * 256 * 4
    expected = JOB_BASE_BYTES + ONNX_BASE_BYTES + 2 * largest + 2 * ONNX_PER_LAYER_BYTES
    assert plan.job_peak_rss_bytes == expected


def test_onnxruntime_maps_the_weights_and_holds_its_own_and_the_logits_apart() -> None:
    """The child's weights are mapped pages (reclaimable: not held against the budget); what
    the budget holds of it is its anonymous part: 40 MiB, and the logits check's float32
    (n_ctx, vocab) copies, whatever the weights."""
    wide, wider = _llama3(8192, 28672), _llama3(16384, 53248)
    a, b = (plan_export(spec("onnx"), h, GiB) for h in (wide, wider))
    logits = ORT_LOGITS_COPIES * REFERENCE_CTX * 128256 * 4
    for plan, headers in ((a, wide), (b, wider)):
        ort, genai = plan.children
        assert ort.mapped_bytes == genai.mapped_bytes == plan.artifact_bytes
        assert plan.artifact_bytes > 10 * GiB
        assert ort.peak_rss_bytes - ort.mapped_bytes == ORT_BASE_BYTES + logits
        assert genai.peak_rss_bytes - genai.mapped_bytes == ORT_BASE_BYTES
    assert a.budget_peak_bytes == b.budget_peak_bytes  # the children's mapped weights aside
    assert "mapped weights" in a.notes[0] and "(375 MiB anonymous)" in a.notes[0]
    # without a tokenizer there is no logits check: the runtime's own 40 MiB
    bare = plan_export(spec("onnx"), llama(1, 8192, 28672, 128256, dtype="BF16"), GiB)
    assert bare.children[0].peak_rss_bytes - bare.children[0].mapped_bytes == ORT_BASE_BYTES
