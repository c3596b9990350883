"""The plan's arithmetic on headers alone (no torch, no tools): what each format's formula
grows with, how a job's exports add up, and when a job does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.checkpoint.headers import CheckpointHeaders, TensorHeader
from service.config import QUANTIZER_BUFFER, Settings
from service.exporters import plan_export
from service.exporters.base import ExportSpec
from service.exporters.gguf.plan import CHUNK_BYTES, QUANTIZER_BASE_BYTES
from service.jobs.spec import JobSpec
from service.plan import ChildPlan, ExportPlan, plan_job

GiB = 1 << 30
MiB = 1 << 20


def llama(layers: int, hidden: int = 2048, inter: int = 5632, vocab: int = 32000,
          dtype: str = "F32", experts: int = 0) -> CheckpointHeaders:  # fmt: skip
    """A Llama-shaped (Mixtral-shaped with ``experts``) checkpoint's headers."""
    tensors = [TensorHeader("model.embed_tokens.weight", dtype, (vocab, hidden)),
               TensorHeader("lm_head.weight", dtype, (vocab, hidden))]  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [TensorHeader(p + f"self_attn.{n}_proj.weight", dtype, (hidden, hidden))
                    for n in "qkvo"]  # fmt: skip
        mlp = [("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))]
        if experts:
            tensors += [
                TensorHeader(p + f"block_sparse_moe.experts.{x}.{w}.weight", dtype, shape)
                for x in range(experts)
                for w, (_, shape) in zip(("w1", "w3", "w2"), mlp, strict=True)
            ]
        else:
            tensors += [TensorHeader(p + f"mlp.{n}_proj.weight", dtype, s) for n, s in mlp]
        tensors.append(TensorHeader(p + "input_layernorm.weight", dtype, (hidden,)))
    config = {"num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
              "architectures": ["MixtralForCausalLM" if experts else "LlamaForCausalLM"]}  # fmt: skip
    files = {"model.safetensors": sum(t.nbytes for t in tensors)}
    return CheckpointHeaders("safetensors", files, tuple(tensors), config, ("model.safetensors",))


def spec(format: str, **fields: object) -> ExportSpec:
    """An export spec as a request gives it."""
    if format == "gguf":
        fields.setdefault("type", "f16")
    job = JobSpec.model_validate({"source": "file:///m", "exports": [{"format": format, **fields}]})
    return job.export_specs()[0]


def test_streaming_exports_do_not_grow_with_the_model_but_whole_model_consumers_do() -> None:
    small, large = llama(3), llama(30)
    assert large.weight_bytes > 5 * small.weight_bytes
    for format in ("gguf", "safetensors"):
        a = plan_export(spec(format), small, GiB, verify=False)
        b = plan_export(spec(format), large, GiB, verify=False)
        assert a.job_peak_rss_bytes == b.job_peak_rss_bytes, format
    onnx_small, onnx_large = (plan_export(spec("onnx"), h, GiB) for h in (small, large))
    # onnxruntime, then onnxruntime-genai's generator (the genai layout), each mapping the weights
    assert [c.name for c in onnx_small.children] == ["onnxruntime", "onnxruntime-genai"]
    (ort_small, _), (ort_large, _) = onnx_small.children, onnx_large.children
    assert ort_large.peak_rss_bytes - ort_small.peak_rss_bytes >= large.weight_bytes - small.weight_bytes
    assert onnx_large.job_peak_rss_bytes - onnx_small.job_peak_rss_bytes < 200 << 20  # the graph


def test_a_mixtral_gguf_plan_is_the_dense_formula_whatever_the_expert_stack() -> None:
    """Experts stream one after the other: the stack (8 x 5632 x 2048 x 4 B = 369 MiB in
    float32 per projection) is not a term; the q projection llama.cpp permutes is. (The
    independent reference of a verified job is another matter: transformers loads a layer's
    experts together, its packed experts module, layer by layer or module by module.)"""
    dense = plan_export(spec("gguf", type="q8_0"), llama(4), GiB, verify=False)
    for experts in (8, 16):
        moe = plan_export(spec("gguf", type="q8_0"), llama(4, experts=experts), GiB, verify=False)
        assert moe.job_peak_rss_bytes == dense.job_peak_rss_bytes
        assert moe.artifact_bytes > dense.artifact_bytes * experts / 4  # the file does grow
        verified = plan_export(spec("gguf", type="q8_0"), llama(4, experts=experts), GiB)
        assert any("module by module" in note for note in verified.notes), verified.notes
        stack = experts * 3 * 5632 * 2048 * 4  # the experts of one layer, float32
        assert verified.job_peak_rss_bytes > 1.7 * stack


def test_a_k_quant_plans_the_quantizer_and_the_f16_scratch_file() -> None:
    plan = plan_export(spec("gguf", type="Q4_K_M"), llama(3), GiB)
    names = [c.name for c in plan.children]
    assert names == ["llama-quantize", "llama-perplexity"]
    f16 = plan_export(spec("gguf", type="f16"), llama(3), GiB)
    assert plan.scratch_bytes == f16.artifact_bytes
    assert plan.artifact_bytes < f16.artifact_bytes / 3


def test_llama_quantize_holds_its_row_block_not_a_float32_copy_of_the_largest_tensor(
    tmp_path: Path,
) -> None:
    """Llama-3-70B's and Llama-3.1-405B's widths (embedding 1.05 G and 2.1 G elements): what
    llama-quantize holds beyond its mapped f16 rows is its row block, flat in the width; the
    mapped rows (clean page cache) grow with the tensor and are planned as such."""
    held = []
    for hidden, inter in ((8192, 28672), (16384, 53248)):
        headers = llama(1, hidden, inter, vocab=128256, dtype="BF16")
        largest = headers.largest()
        assert largest is not None
        (quantizer, _) = plan_export(spec("gguf", type="Q4_K_M"), headers, GiB).children
        assert quantizer.name == "llama-quantize"
        assert quantizer.mapped_bytes == 2 * largest.numel
        held.append(quantizer.peak_rss_bytes - quantizer.mapped_bytes)
    assert held[0] == pytest.approx(held[1], rel=0.01)
    # the block's rows, the float32 ones twice (a growing buffer's copy): 1.28 x the block
    assert QUANTIZER_BASE_BYTES < held[0] <= QUANTIZER_BASE_BYTES + 1.3 * QUANTIZER_BUFFER
    # the block is the setting's: a smaller one plans a smaller quantizer
    settings = Settings(data_dir=tmp_path, memory_limit="2560MiB", quantizer_buffer="64MiB")
    (small, _) = plan_export(spec("gguf", type="Q4_K_M"), headers, GiB, settings=settings).children
    assert small.peak_rss_bytes - small.mapped_bytes <= QUANTIZER_BASE_BYTES + 1.3 * 64 * MiB
    # a tensor smaller than the block is converted whole, and planned so
    tiny = llama(1, hidden=256, inter=512, vocab=1000)
    (whole, _) = plan_export(spec("gguf", type="Q4_K_M"), tiny, GiB).children
    largest = tiny.largest()
    assert largest is not None
    assert whole.peak_rss_bytes - whole.mapped_bytes == QUANTIZER_BASE_BYTES + int(
        largest.numel * (2 * 4 + 34 / 32)
    )


def test_a_reference_whose_layer_does_not_fit_runs_module_by_module_flat_in_the_width() -> None:
    """One layer at 70B and 405B widths (0.86 and 2.9 G elements) x 1.7 in float32 is over a
    1 GiB max_memory: the reference holds its largest module, a projection in row blocks of
    64 MiB read from the file, so its term is the same at both widths; a layer that fits
    stays layer by layer."""
    from service.plan.terms import REFERENCE_LINEAR_BLOCK_BYTES, reference_bytes
    from service.verification.mapped import LINEAR_BLOCK_BYTES

    assert REFERENCE_LINEAR_BLOCK_BYTES == LINEAR_BLOCK_BYTES
    terms = []
    for hidden, inter in ((8192, 28672), (16384, 53248)):
        peak, note = reference_bytes(llama(1, hidden, inter, vocab=128256, dtype="BF16"), GiB)
        assert "module by module" in note, note
        terms.append(peak)
    assert terms[0] == terms[1]
    assert terms[0] < GiB
    _, note = reference_bytes(llama(3, 1024, 2816, vocab=32000, dtype="BF16"), 128 << 20)
    assert "layer by layer" in note, note


def test_verify_false_plans_no_consumer_child() -> None:
    for format in ("onnx", "nnef"):
        plan = plan_export(spec(format), llama(3), GiB, verify=False)
        assert plan.children == () and plan.verification == "none"
    gguf = plan_export(spec("gguf"), llama(3), GiB, verify=False)
    assert gguf.verification == "layout"
    assert gguf.job_peak_rss_bytes < plan_export(spec("gguf"), llama(3), GiB).job_peak_rss_bytes


def test_a_job_adds_its_exports_files_and_refuses_with_the_numbers() -> None:
    headers = llama(3)
    a = ExportPlan("gguf", 700 << 20, 500 << 20, (ChildPlan("llama-quantize", 300 << 20),),
                   artifact_bytes=100, scratch_bytes=50)  # fmt: skip
    b = ExportPlan("onnx", 900 << 20, 900 << 20, (ChildPlan("onnxruntime", 600 << 20),),
                   artifact_bytes=200)  # fmt: skip
    fits = plan_job(headers, [a, b], memory_budget_bytes=2 * GiB, disk_free_bytes=10**6)
    assert fits.fits and fits.group_peak_bytes == (900 + 600) << 20
    assert fits.peak_rss_bytes == 900 << 20
    assert fits.disk.staging_bytes == 350 and fits.disk.artifact_bytes == 300
    refused = plan_job(headers, [a, b], memory_budget_bytes=GiB, disk_free_bytes=100)
    assert not refused.fits
    memory, disk = refused.refusals
    assert "1.46 GiB" in memory and "onnx export" in memory and "1.00 GiB budget" in memory
    assert "data directory" in disk


def test_the_gguf_plan_row_blocks_are_bounded_by_the_largest_tensor() -> None:
    tiny = llama(1, hidden=64, inter=128, vocab=256)
    plan = plan_export(spec("gguf"), tiny, GiB)
    big = plan_export(spec("gguf"), llama(1), GiB)
    assert big.job_peak_rss_bytes - plan.job_peak_rss_bytes > CHUNK_BYTES
