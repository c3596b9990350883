"""A vision-language model's GGUF plan: the projector file is counted, and a verified export
counts the mtmd check's whole-model transformers reference, so a VLM that cannot be checked
within the budget is refused at submission instead of running out of memory in the job."""

from __future__ import annotations

from service.checkpoint.headers import CheckpointHeaders, TensorHeader
from service.exporters import plan_export
from service.jobs.spec import JobSpec
from service.plan import plan_job
from service.plan.terms import JOB_BASE_BYTES, REFERENCE_BASE_BYTES, REFERENCE_WEIGHT_FACTOR

MiB = 1 << 20


def gemma3(vision_layers: int, hidden: int = 1024, vocab: int = 4096) -> CheckpointHeaders:
    """Headers of a Gemma 3-shaped VLM (tower under ``vision_tower.vision_model``)."""
    tensors = [TensorHeader("language_model.model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(2):
        p = f"language_model.model.layers.{i}."
        tensors += [TensorHeader(p + f"self_attn.{n}_proj.weight", "BF16", (hidden, hidden))
                    for n in "qkvo"]  # fmt: skip
        tensors.append(TensorHeader(p + "input_layernorm.weight", "BF16", (hidden,)))
    for i in range(vision_layers):
        p = f"vision_tower.vision_model.encoder.layers.{i}."
        tensors += [TensorHeader(p + f"mlp.fc{n}.weight", "BF16", (4 * hidden, hidden))
                    for n in (1, 2)]  # fmt: skip
        tensors.append(TensorHeader(p + "layer_norm1.weight", "BF16", (hidden,)))
    tensors.append(TensorHeader("multi_modal_projector.mm_input_projection_weight", "BF16",
                                (hidden, hidden)))  # fmt: skip
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"num_hidden_layers": 2, "hidden_size": hidden, "vocab_size": vocab},
        "vision_config": {"num_hidden_layers": vision_layers, "model_type": "siglip_vision_model"},
    }  # fmt: skip
    files = {"model.safetensors": sum(t.nbytes for t in tensors), "tokenizer.model": 1}
    return CheckpointHeaders("safetensors", files, tuple(tensors), config, ("model.safetensors",))


def gguf(type_name: str, **fields: object) -> object:
    request = {"source": "file:///m", "exports": [{"format": "gguf", "type": type_name, **fields}]}
    return JobSpec.model_validate(request).export_specs()[0]


def test_a_verified_vlm_plans_the_whole_float32_reference_and_llama_mtmd_cli() -> None:
    headers = gemma3(vision_layers=8)
    plan = plan_export(gguf("f16"), headers, max_memory=16 * MiB)
    weights = sum(t.numel for t in headers.tensors) * 4
    reference = JOB_BASE_BYTES + REFERENCE_BASE_BYTES + int(REFERENCE_WEIGHT_FACTOR * weights)
    assert plan.job_peak_rss_bytes >= reference  # whole, whatever max_memory
    (mtmd,) = [c for c in plan.children if c.name == "llama-mtmd-cli"]
    assert mtmd.peak_rss_bytes > plan.artifact_bytes > mtmd.mapped_bytes > 0
    assert any("mtmd check" in n for n in plan.notes)
    vision = sum(t.numel for t in headers.tensors if t.name.startswith(("vision", "multi"))) * 2
    assert any(f"{vision >> 20} MiB" in n for n in plan.notes if n.startswith("projector"))


def test_an_unverified_vlm_streams_its_tower_like_the_text_model() -> None:
    small, large = gemma3(vision_layers=2), gemma3(vision_layers=24)
    a, b = (plan_export(gguf("f16", verify=False), h, 16 * MiB) for h in (small, large))
    assert a.job_peak_rss_bytes == b.job_peak_rss_bytes and not b.children
    assert b.artifact_bytes - a.artifact_bytes >= 22 * 2 * 4 * 1024 * 1024 * 2  # the tower, f16


def test_a_k_quant_vlm_plans_its_mtmd_check_on_the_f16_text_file() -> None:
    headers = gemma3(vision_layers=2)
    k_quant, f16 = (plan_export(gguf(t), headers, 16 * MiB) for t in ("Q4_K_M", "f16"))
    (mtmd,) = [c for c in k_quant.children if c.name == "llama-mtmd-cli"]
    (f16_mtmd,) = [c for c in f16.children if c.name == "llama-mtmd-cli"]
    assert mtmd.mapped_bytes >= f16_mtmd.mapped_bytes
    assert k_quant.job_peak_rss_bytes >= f16.job_peak_rss_bytes


def test_a_vlm_whose_mtmd_reference_exceeds_the_budget_is_refused_with_its_numbers() -> None:
    headers = gemma3(vision_layers=48)
    verified = plan_export(gguf("f16"), headers, 16 * MiB)
    unverified = plan_export(gguf("f16", verify=False), headers, 16 * MiB)
    budget = (unverified.budget_peak_bytes + verified.budget_peak_bytes) // 2
    assert plan_job(headers, [unverified], budget, None).fits
    refused = plan_job(headers, [verified], budget, None)
    assert not refused.fits
    assert "job process" in refused.refusals[0] and "MODELPREP_JOB_MEMORY" in refused.refusals[0]
