"""A vision-language model through the service: GGUF writes the text model and its projector,
llama-mtmd-cli agrees with transformers on the fixed image, safetensors keeps every sub-model and
the processor files, and the formats and families that cannot take it refuse it at submission.

The checkpoints are tiny random models of each family taken (``mmproj.VLM_FAMILIES``: Gemma 3
and 4, SmolVLM/Idefics3, SmolVLM2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, GLM-4.1V, Pixtral
under LLaVA, Mistral 3, Janus-Pro; ``tests.fixtures.vlm``: no registry ships a small VLM's
weights), the real consumer is
llama.cpp's own ``llama-mtmd-cli`` and the reference is transformers' class of each.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from service.api.errors import http_status
from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import ExportFailed, UnsupportedExport, VerificationFailed
from service.exporters.base import ExportInputs
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.exporters.gguf.mmproj import (
    RUNTIME_DIFFERS,
    VLM_FAMILIES,
    check_tower,
    plan_mmproj,
    vision_tensors,
)
from service.exporters.gguf.mtmd_check import LAYOUTS, TOKENS, check_mtmd
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.service import check_spec
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
from tests.fixtures.vlm import (
    cached_gemma4,
    cached_glm4v,
    cached_janus,
    cached_pixtral,
    cached_qwen3vl,
    cached_qwen3vl_moe,
    cached_smolvlm2,
    write_tiny_gemma3,
    write_tiny_idefics3,
    write_tiny_qwen2vl,
)

PROCESSOR_FILES = ("preprocessor_config.json", "chat_template.jinja", "tokenizer.model",
                   "tokenizer.json", "tokenizer_config.json", "config.json")  # fmt: skip


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vlm") / "models" / "gemma3"
    write_tiny_gemma3(root)
    return root


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2vl(tmp_path_factory.mktemp("vlm") / "models" / "qwen2vl")


def _export(ckpt: Path, out: Path, **spec: Any) -> dict[str, Any]:
    ctx = InMemoryContext(Settings(data_dir=out / ".var"), out / ".work")
    out.mkdir(parents=True, exist_ok=True)
    with open_checkpoint(ckpt) as c:
        result = GGUFExporter().export(GGUFSpec(**spec), ExportInputs(c), out, ctx)
    assert result.files == sorted(result.files, key=lambda n: n.startswith("mmproj-"))
    assert set(result.digests) == set(result.files)
    return result.summary


def _agrees(mtmd: dict[str, Any]) -> None:
    """Both prompts (image first, and the image inside the family's chat turn) agree with
    transformers on all :data:`TOKENS` tokens: greedy, or teacher-forced after a near tie."""
    assert mtmd["result"] == "agree", mtmd
    assert set(mtmd["prompts"]) == {"image_first", "chat_turn"}, mtmd
    for style, report in mtmd["prompts"].items():
        assert report["tokens"] == TOKENS, (style, report)
        forced = report.get("teacher_forced_steps", 0)
        assert report["agreed_tokens"] + forced >= TOKENS, (style, report)


PLAN_BOUND = 0.25
"""How far llama-mtmd-cli's measured peak may be from the plan's (``gguf.plan._mtmd_peak``)."""


def _assert_planned(root: Path, summary: dict[str, Any], work: Path) -> None:
    """llama-mtmd-cli's own peak RSS (its VmHWM, not the job's RSS at fork, which is ~430 MiB
    here) is within :data:`PLAN_BOUND` of what the plan predicted for the checkpoint."""
    from service.exporters import plan_export
    from service.jobs.planning import source_headers

    spec = JobSpec.model_validate(
        {"source": f"file://{root}", "exports": [{"format": "gguf", "type": "f16"}]}
    )
    settings = Settings(data_dir=work / "plan-data", local_roots=[root.parent])
    headers = source_headers(spec, settings)
    plan = plan_export(spec.export_specs()[0], headers, max_memory=1 << 30)
    (child,) = [c for c in plan.children if c.name == "llama-mtmd-cli"]
    measured = summary["mmproj"]["mtmd"]["peak_rss_bytes"]
    ratio = measured / child.peak_rss_bytes
    assert abs(ratio - 1) <= PLAN_BOUND, (
        f"llama-mtmd-cli peaked at {measured >> 10} KiB, the plan said "
        f"{child.peak_rss_bytes >> 10} KiB (ratio {ratio:.3f})"
    )


def test_a_verified_vlm_job_writes_gguf_with_its_projector_and_safetensors_with_every_part(
    qwen2vl: Path, tmp_path: Path
) -> None:
    """The whole pipeline, max_memory small enough that both towers stream through the
    offload store layer by layer."""
    settings = Settings(data_dir=tmp_path / "data", local_roots=[qwen2vl.parent])
    layout = JobLayout.for_job(settings, "d" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="d" * 32)
    spec = JobSpec.model_validate({
        "source": f"file://{qwen2vl}", "max_memory": "100KB",
        "exports": [{"format": "safetensors"}, {"format": "gguf", "type": "f16"}],
    })  # fmt: skip
    run_pipeline(spec, ctx, layout)
    manifest = json.loads((layout.artifacts / "manifest.json").read_text())
    safetensors, gguf = manifest["exports"]

    names = {Path(a["path"]).name for a in manifest["files"]}
    assert set(PROCESSOR_FILES) <= names, f"processor files missing from {sorted(names)}"
    assert {"model-f16.gguf", "mmproj-model-f16.gguf"} <= names
    from safetensors import safe_open

    with open_checkpoint(qwen2vl) as source:
        wanted = {i.name for i in source.reader.tensor_infos()}
        vision_bytes = sum(vision_tensors(source.reader).values())
    written: set[str] = set()
    for path in (layout.artifacts / "safetensors").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            written |= set(f.keys())
    assert written == wanted  # the vision tower, the projector and the language model
    assert safetensors["verify"]["passed"]

    mmproj = gguf["mmproj"]
    assert mmproj["converter"].endswith("Qwen2VLVisionModel")
    assert mmproj["tower"]["vision_blocks"] == 4 and mmproj["verification"]["read_back"]
    _agrees(mmproj["mtmd"])
    offload = ctx.details["offload"]  # the tower went to the store like the text model's layers
    stored = offload["bytes_referenced"] + offload["bytes_written"]
    assert stored >= vision_bytes, f"{stored} bytes in the store, the tower alone is {vision_bytes}"


def test_a_q8_0_vlm_gets_an_f16_projector_that_llama_cpp_runs_like_transformers(
    qwen2vl: Path, tmp_path: Path
) -> None:
    summary = _export(qwen2vl, tmp_path / "out", type="q8_0")
    mmproj = summary["mmproj"]
    assert mmproj["type"] == "f16" and mmproj["file"] == "mmproj-model-f16.gguf"
    assert "f16" in mmproj["verification"]["max_abs_error"]
    assert mmproj["mtmd"]["text_model"].startswith("an f16 file"), mmproj["mtmd"]
    assert summary["files"] == ["model-q8_0.gguf", "mmproj-model-f16.gguf"]  # the f16 text: gone
    _agrees(mmproj["mtmd"])


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_idefics3(tmp_path_factory.mktemp("smolvlm") / "smolvlm")


def test_a_smolvlm_gets_its_text_model_and_projector_that_llama_cpp_runs_like_transformers(
    smolvlm: Path, tmp_path: Path
) -> None:
    """Idefics3/SmolVLM: the text model by text_config's VLlama3ForCausalLM, the projector by
    upstream's SmolVLM class, and mtmd's tiled sequence (one tile and the overview) agreeing
    with transformers' Idefics3ForConditionalGeneration on the same frames."""
    summary = _export(smolvlm, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == "VLlama3ForCausalLM"
    mmproj = summary["mmproj"]
    assert mmproj["file"] == "mmproj-model-f16.gguf"
    assert mmproj["converter"].endswith("SmolVLMModel")
    assert mmproj["tower"]["vision_blocks"] == 3 and mmproj["verification"]["read_back"]
    assert mmproj["verification"]["tensors_checked"] == mmproj["tensors"]
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(smolvlm, summary, tmp_path)


def test_a_smolvlm2_gets_the_smolvlm_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path,
) -> None:
    """SmolVLM2 (SmolVLMForConditionalGeneration): Idefics3's layout under its own class,
    converted by the same upstream classes and laid out by mtmd as Idefics3."""
    root = cached_smolvlm2()
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == "VLlama3ForCausalLM"
    mmproj = summary["mmproj"]
    assert mmproj["architecture"] == "SmolVLMForConditionalGeneration"
    assert mmproj["converter"].endswith("SmolVLMModel") and mmproj["tower"]["vision_blocks"] == 3
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)


@pytest.mark.parametrize(
    ("version", "arch", "projector"),
    [("2", "Qwen2VLForConditionalGeneration", "qwen2vl_merger"),
     ("2.5", "Qwen2_5_VLForConditionalGeneration", "qwen2.5vl_merger")],
)  # fmt: skip
def test_a_qwen2_vl_gets_its_text_model_and_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path, version: str, arch: str, projector: str
) -> None:
    """Qwen2-VL and Qwen2.5-VL (windowed vision attention, full attention every second block):
    the text model by upstream's QWEN2VL class with its M-RoPE sections, the projector by its
    merger class, and mtmd's image (8x8 merged patches between <|vision_start|> and
    <|vision_end|>, at M-RoPE positions) agreeing with transformers, which is given the same
    positions through mm_token_type_ids."""
    root = write_tiny_qwen2vl(tmp_path / "qwen2vl", version=version)
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == arch
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("Qwen2VLVisionModel")
    assert mmproj["tower"]["vision_blocks"] == 4 and mmproj["verification"]["read_back"]
    from gguf import GGUFReader

    fields = GGUFReader(tmp_path / "out" / mmproj["file"]).fields
    assert bytes(fields["clip.projector_type"].parts[-1]).decode() == projector
    _agrees(mmproj["mtmd"])
    _assert_planned(root, summary, tmp_path)


@pytest.mark.parametrize(
    ("merge", "arch", "text_arch"),
    [(1, "LlavaForConditionalGeneration", "llama"), (2, "Mistral3ForConditionalGeneration",
                                                     "mistral3")],
)  # fmt: skip
def test_a_pixtral_vlm_gets_its_projector_with_the_row_break_that_llama_cpp_runs_like_transformers(
    tmp_path: Path, merge: int, arch: str, text_arch: str
) -> None:
    """Pixtral under LLaVA and Mistral 3 (Pixtral tower, RMSNorm and 2x2 patch merger): the
    projector holds the [IMG_BREAK] row of the text embedding (upstream's class reads it from
    an embedding its base class filters away; without it llama-mtmd-cli refuses the file), and
    mtmd's rows of patches, a break after each but the last, then [IMG_END], agree with
    transformers given the same ids and the image's size."""
    from gguf import GGUFReader

    root = cached_pixtral(merge)
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == arch
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("LlavaVisionModel")
    assert mmproj["tower"]["vision_blocks"] == 3 and mmproj["verification"]["read_back"]
    text = GGUFReader(tmp_path / "out" / "model-f16.gguf").fields
    assert bytes(text["general.architecture"].parts[-1]).decode() == text_arch
    projector = GGUFReader(tmp_path / "out" / mmproj["file"])
    assert bytes(projector.fields["clip.projector_type"].parts[-1]).decode() == "pixtral"
    tensors = {t.name: t for t in projector.tensors}
    with open_checkpoint(root) as c:
        embedding = c.reader.read("language_model.model.embed_tokens.weight")
    brk = json.loads((root / "tokenizer.json").read_text())["model"]["vocab"].get("[IMG_BREAK]")
    if brk is None:
        brk = next(t["id"] for t in json.loads((root / "tokenizer.json").read_text())[
            "added_tokens"] if t["content"] == "[IMG_BREAK]")  # fmt: skip
    row = tensors["v.token_embd.img_break"].data.astype("float32")
    assert row.shape == (embedding.shape[1],)
    assert abs(row - embedding[brk].numpy()).max() < 1e-2, "not the [IMG_BREAK] row"
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(root, summary, tmp_path)


@pytest.mark.parametrize(("side", "patch", "merge"), [(1024, 16, 1), (1540, 14, 2)])
def test_a_published_pixtrals_fixed_image_is_one_neither_mtmd_nor_transformers_resizes(
    side: int, patch: int, merge: int
) -> None:
    """Pixtral 12B and Mistral Small 3.1: their tower's image_size is more embeddings than
    mtmd takes of one image (1024, it would shrink the image), so the fixed image is 16 merged
    patches a side, a multiple of the merged patch and under the processor's longest edge."""
    from service.exporters.gguf.mtmd_check import image_size

    config = {"spatial_merge_size": merge,
              "vision_config": {"model_type": "pixtral", "image_size": side, "patch_size": patch}}  # fmt: skip
    pixels = image_size(config)
    assert pixels % (patch * merge) == 0 and pixels <= side
    assert 8 <= (pixels // (patch * merge)) ** 2 <= 1024


def test_a_qwen3_vl_gets_its_deepstack_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path,
) -> None:
    """Qwen3-VL: the text model by upstream's Qwen3-VL class (interleaved M-RoPE, deepstack
    layers), the projector with its deepstack mergers, and mtmd's 7x7 merged patches between
    <|vision_start|> and <|vision_end|> agreeing with transformers."""
    from gguf import GGUFReader

    root = cached_qwen3vl()
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == "Qwen3VLForConditionalGeneration"
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("Qwen3VLVisionModel"), mmproj["converter"]
    fields = GGUFReader(tmp_path / "out" / "model-f16.gguf").fields
    assert int(fields["qwen3vl.n_deepstack_layers"].contents()) == 2
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(root, summary, tmp_path)


def test_a_qwen3_vl_moe_gets_its_experts_and_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path,
) -> None:
    """Qwen3-VL-MoE: the text model by upstream's Qwen3-VL-MoE class with the packed experts
    transformers 5 writes in its own [E, out, in] orientation (upstream's class would transpose
    them as the Hub's [E, in, out]), the deepstack projector, and mtmd agreeing with
    transformers on the image."""
    from gguf import GGUFReader

    root = cached_qwen3vl_moe()
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == "Qwen3VLMoeForConditionalGeneration"
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("Qwen3VLVisionModel"), mmproj["converter"]
    reader = GGUFReader(tmp_path / "out" / "model-f16.gguf")
    assert int(reader.fields["qwen3vlmoe.n_deepstack_layers"].contents()) == 2
    config = json.loads((root / "config.json").read_text())["text_config"]
    experts, hidden, ff = (
        config[k] for k in ("num_local_experts", "hidden_size", "moe_intermediate_size")
    )
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml order
    assert shapes["blk.0.ffn_gate_exps.weight"] == (hidden, ff, experts)
    assert shapes["blk.0.ffn_up_exps.weight"] == (hidden, ff, experts)
    assert shapes["blk.0.ffn_down_exps.weight"] == (ff, hidden, experts)
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(root, summary, tmp_path)


def test_a_glm_4_1v_gets_its_text_model_and_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path,
) -> None:
    """GLM-4.1V: the text model by upstream's GLM-4 class (M-RoPE over half of each head, its
    byte-level BPE vocabulary), the projector by its GLM-4V class (the convolution that merges
    2x2 patches, the SwiGLU merger), and mtmd's 4x4 merged patches between
    <|begin_of_image|> and <|end_of_image|> agreeing with transformers."""
    from gguf import GGUFReader

    root = cached_glm4v()
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == "Glm4vForConditionalGeneration"
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("Glm4VVisionModel"), mmproj["converter"]
    assert mmproj["tower"]["vision_blocks"] == 3 and mmproj["verification"]["read_back"]
    text = GGUFReader(tmp_path / "out" / "model-f16.gguf").fields
    assert bytes(text["general.architecture"].parts[-1]).decode() == "glm4"
    assert bytes(text["tokenizer.ggml.pre"].parts[-1]).decode() == "smollm"
    projector = GGUFReader(tmp_path / "out" / mmproj["file"]).fields
    assert bytes(projector["clip.projector_type"].parts[-1]).decode() == "glm4v"
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(root, summary, tmp_path)


def test_a_gemma_4_gets_its_text_model_and_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path,
) -> None:
    """Gemma 4 (tied embeddings, per-layer inputs, proportional RoPE on the full layer): the
    projector by upstream's Gemma 4 class, handed the stored tensors only (not the reader's
    lm_head alias of the tied embedding, which it cannot map), and mtmd's 11 x 11 pooled soft
    tokens between <|image> and <image|>, attended bidirectionally, agreeing with
    transformers."""
    from gguf import GGUFReader

    root = cached_gemma4()
    summary = _export(root, tmp_path / "out", type="f16")
    assert summary["hf_architecture"] == "Gemma4ForConditionalGeneration"
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("Gemma4VisionAudioModel"), mmproj["converter"]
    assert mmproj["tower"]["vision_blocks"] == 2 and mmproj["verification"]["read_back"]
    projector = GGUFReader(tmp_path / "out" / mmproj["file"]).fields
    assert bytes(projector["clip.vision.projector_type"].parts[-1]).decode() == "gemma4v"
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(root, summary, tmp_path)


def test_a_janus_pro_gets_its_projector_that_llama_cpp_runs_like_transformers(
    tmp_path: Path,
) -> None:
    """Janus-Pro: the Llama text model without the generation heads and VQ-VAE, the SigLIP
    tower and aligner as the projector, and mtmd's bare image embeddings (no markers) agreeing
    with transformers' JanusForConditionalGeneration on the same ids."""
    root = cached_janus()
    summary = _export(root, tmp_path / "out", type="f16")
    mmproj = summary["mmproj"]
    assert mmproj["converter"].endswith("JanusProVisionModel") and summary["hf_architecture"] == (
        "JanusForConditionalGeneration"
    )
    assert mmproj["tower"]["vision_blocks"] == 3
    mtmd = mmproj["mtmd"]
    _agrees(mtmd)
    _assert_planned(root, summary, tmp_path)


def test_a_nul_byte_token_which_llama_cpp_cannot_print_still_agrees() -> None:
    """llama.cpp prints through C strings: the <0x00> byte token prints nothing, so it is
    compared as nothing (Janus-Pro's tiny model greedily emits one)."""
    from service.exporters.gguf.mtmd_check import Greedy, compare

    reference = Greedy(ids=[5, 3, 7, 9], margins=[1.0] * 4, pieces=[b"a", b"\x00", b"b", b"c"],
                       near=[{5}, {3}, {7}, {9}])  # fmt: skip
    assert compare(b"\nabc\n", reference)["agreed_tokens"] == 4
    with pytest.raises(VerificationFailed, match="diverges"):
        compare(b"\nabd\n", reference)


def test_a_k_quant_vlms_projector_is_checked_by_mtmd_with_the_f16_it_was_quantized_from(
    smolvlm: Path, tmp_path: Path
) -> None:
    """Q4_K_M ships an f16 projector; llama-mtmd-cli runs it with the f16 text file
    llama-quantize read (kept until then, removed after) against transformers."""
    summary = _export(smolvlm, tmp_path / "out", type="Q4_K_M")
    assert summary["files"] == ["model-Q4_K_M.gguf", "mmproj-model-f16.gguf"]
    mtmd = summary["mmproj"]["mtmd"]
    assert "skipped" not in mtmd and mtmd["text_model"].startswith("the f16 file"), mtmd
    _agrees(mtmd)
    assert not list((tmp_path / "out" / ".work").rglob("*.gguf"))


def test_every_vlm_family_taken_has_an_mtmd_layout() -> None:
    """No family is written with a projector the job cannot check (Gemma 3 keeps its layout:
    the check runs on it, and found llama.cpp's runtime prompting it otherwise)."""
    assert set(VLM_FAMILIES) | set(RUNTIME_DIFFERS) == set(LAYOUTS)


@pytest.mark.parametrize("published", [True, False])
def test_gemma3_is_refused_at_submission_with_llama_cpps_sequence_and_the_reference(
    tmp_path: Path, published: bool
) -> None:
    """Gemma 3, in the Hub's layout or as transformers 5 saves it: llama.cpp's mtmd writes its
    image without the two newlines transformers' processor puts around it, so llama.cpp
    answers a user's prompt otherwise than transformers (the check measured it, see
    mmproj.RUNTIME_DIFFERS); the job is refused before any work, naming both sources."""
    root = tmp_path / "models" / "gemma3"
    write_tiny_gemma3(root, published=published)
    settings = Settings(data_dir=tmp_path / "data", local_roots=[root.parent])
    config = json.loads((root / "config.json").read_text())
    spec = JobSpec.model_validate({"source": f"file://{root}", "exports": [{"format": "gguf"}]})
    with pytest.raises(UnsupportedExport) as refused:
        check_spec(spec, settings, config, config_known=True, source_dir=root)
    assert http_status(refused.value) == 422
    message = str(refused.value)
    assert "PROJECTOR_TYPE_GEMMA3" in message and "full_image_sequence" in message, message


def test_gemma3_as_transformers_5_saves_it_reaches_llama_cpps_converter_as_published(
    tmp_path: Path,
) -> None:
    """transformers 5.23's save_pretrained writes Gemma 3's tower as vision_tower.embeddings.*
    (the Hub: vision_tower.vision_model.*); upstream's Gemma3VisionModel could not map it.
    Through transformers' own rules the converter is handed the published names: the same
    projector, tensor for tensor, as from the Hub's layout."""
    hub, saved = tmp_path / "hub", tmp_path / "saved"
    write_tiny_gemma3(hub)
    write_tiny_gemma3(saved, published=False)
    plans = []
    for root in (hub, saved):
        with open_checkpoint(root) as c:
            assert c.config is not None
            names = {i.name for i in c.reader.tensor_infos()}
            plan = plan_mmproj(root, c.config, c.reader, "f16")
            check_tower(plan, c.reader, c.config)
            plans.append(plan)
    assert "vision_tower.embeddings.patch_embedding.bias" in names  # the saved layout
    assert [(t.name, t.shape) for t in plans[0].tensors] == [
        (t.name, t.shape) for t in plans[1].tensors
    ]


def test_a_layout_transformers_cannot_load_is_refused_at_submission(
    qwen2vl: Path, tmp_path: Path
) -> None:
    """A VLM whose tensor names transformers' rules map into none of the model's tensors is
    refused before any work, not handed to llama.cpp's converter under unknown names."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / "models" / "renamed"
    shutil.copytree(qwen2vl, root)
    weights = load_file(root / "model.safetensors")
    save_file({k.replace("visual.", "vision_encoder."): v for k, v in weights.items()},
              root / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    settings = Settings(data_dir=tmp_path / "data", local_roots=[root.parent])
    config = json.loads((root / "config.json").read_text())
    spec = JobSpec.model_validate({"source": f"file://{root}", "exports": [{"format": "gguf"}]})
    with pytest.raises(UnsupportedExport, match="layout transformers' own rules"):
        check_spec(spec, settings, config, config_known=True, source_dir=root)


def test_a_remote_sources_layout_is_judged_on_its_headers_before_the_download(
    qwen2vl: Path, tmp_path: Path
) -> None:
    """A hub or S3 source's config and safetensors headers are read at submission with range
    requests (``JobService._check_remote_headers``): the names alone refuse a layout
    transformers cannot load, and pass the Hub's and transformers 5's."""
    from safetensors.torch import load_file, save_file

    from service.checkpoint.headers import CheckpointHeaders, local_file_header
    from service.exporters.gguf.mmproj import check_layout_of_names

    def headers(root: Path) -> CheckpointHeaders:
        weights = root / "model.safetensors"
        return CheckpointHeaders(
            format="safetensors", files={weights.name: weights.stat().st_size},
            tensors=tuple(local_file_header(weights)),
            config=json.loads((root / "config.json").read_text()), remote=True,
        )  # fmt: skip

    settings = Settings(data_dir=tmp_path / "data")
    export = GGUFSpec(format="gguf")
    GGUFExporter().check_headers(export, headers(qwen2vl), settings)
    for published in (True, False):  # Gemma 3 itself is refused (RUNTIME_DIFFERS): its names pass
        write_tiny_gemma3(tmp_path / f"gemma3-{published}", published=published)
        gemma3 = headers(tmp_path / f"gemma3-{published}")
        assert gemma3.config is not None
        check_layout_of_names(gemma3.config, [t.name for t in gemma3.tensors])
    renamed = tmp_path / "renamed"
    shutil.copytree(qwen2vl, renamed)
    weights = load_file(renamed / "model.safetensors")
    save_file({k.replace("visual.", "vision_encoder."): v for k, v in weights.items()},
              renamed / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(UnsupportedExport, match="layout transformers' own rules"):
        GGUFExporter().check_headers(export, headers(renamed), settings)


def test_another_models_projector_fails_the_mtmd_check(qwen2vl: Path, tmp_path: Path) -> None:
    """The check can fail: the same text model with a projector of another seed's vision
    tower (right shapes, right keys, wrong weights) diverges from transformers."""
    other = tmp_path / "other"
    write_tiny_qwen2vl(other, seed=1)
    mine = _export(qwen2vl, tmp_path / "mine", type="f16", verify=False)
    theirs = _export(other, tmp_path / "theirs", type="f16", verify=False)
    assert "mtmd" not in mine["mmproj"] and "mtmd" not in theirs["mmproj"]
    with open_checkpoint(qwen2vl) as c:
        config = c.config
    assert config is not None
    with pytest.raises(VerificationFailed, match="diverges from transformers"):
        check_mtmd(
            tmp_path / "mine" / "model-f16.gguf", tmp_path / "theirs" / "mmproj-model-f16.gguf",
            qwen2vl, config, tmp_path / "work", lambda: None,
        )  # fmt: skip
    shutil.rmtree(other)


def test_a_projector_plan_without_its_vision_tower_is_refused(qwen2vl: Path) -> None:
    """llama.cpp #22656: keys and a projector but no tower loads, then fails on an image."""
    with open_checkpoint(qwen2vl) as c:
        assert c.config is not None
        plan = plan_mmproj(qwen2vl, c.config, c.reader, "f16")
        check_tower(plan, c.reader, c.config)
        towerless = dataclasses.replace(
            plan, tensors=tuple(t for t in plan.tensors if not t.name.startswith("v."))
        )
        with pytest.raises(ExportFailed, match="22656"):
            check_tower(towerless, c.reader, c.config)


@pytest.mark.parametrize("fmt", ["nnef", "onnx"])
def test_the_graph_formats_refuse_a_vlm_at_submission_naming_what_they_take(
    gemma3: Path, tmp_path: Path, fmt: str
) -> None:
    settings = Settings(data_dir=tmp_path, local_roots=[gemma3.parent])
    config = json.loads((gemma3 / "config.json").read_text())
    spec = JobSpec.model_validate({"source": f"file://{gemma3}", "exports": [{"format": fmt}]})
    with pytest.raises(UnsupportedExport) as refused:
        check_spec(spec, settings, config, config_known=True)
    message = str(refused.value)
    assert "Gemma3ForConditionalGeneration" in message
    assert "text models" in message and "safetensors" in message and "GGUF" in message


def _vlm_configs() -> dict[str, dict[str, Any]]:
    """Real configs of the families GGUF does not take, from transformers' own classes (LLaVA's
    default is LLaVA 1.5's CLIP tower)."""
    from transformers import Glm4vMoeConfig, Llama4Config, LlavaConfig, PaliGemmaConfig

    configs = {}
    for cls, arch in ((LlavaConfig, "LlavaForConditionalGeneration"),
                      (Glm4vMoeConfig, "Glm4vMoeForConditionalGeneration"),
                      (Llama4Config, "Llama4ForConditionalGeneration"),
                      (PaliGemmaConfig, "PaliGemmaForConditionalGeneration")):  # fmt: skip
        config = cls().to_dict()
        config["architectures"] = [arch]
        configs[arch] = config
    return configs


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("LlavaForConditionalGeneration", "(llava) for pixtral vision towers only"),
        ("Glm4vMoeForConditionalGeneration", "(qwen3vl), but its projector is not one this"),
        ("Llama4ForConditionalGeneration", "(llama4), but transformers' Llama 4 image processor"),
        ("PaliGemmaForConditionalGeneration", "writes no projector for it"),
    ],
)
def test_a_vlm_family_gguf_does_not_take_is_refused_at_submission_naming_what_it_takes(
    tmp_path: Path, arch: str, why: str
) -> None:
    """LLaVA with a CLIP tower (upstream's class converts Pixtral towers only), GLM-4.5V and
    Llama 4 (upstream writes a projector, which no job here checks) and PaliGemma (no
    projector class) are refused before any download, with the families GGUF takes."""
    config = _vlm_configs()[arch]
    settings = Settings(data_dir=tmp_path)
    spec = JobSpec.model_validate(
        {"source": "hf://org/model", "exports": [{"format": "gguf", "type": "q8_0"}]}
    )
    with pytest.raises(UnsupportedExport) as refused:
        check_spec(spec, settings, config, config_known=True, source_checked=True)
    assert http_status(refused.value) == 422
    message = str(refused.value)
    assert arch in message and why in message, message
    assert all(taken in message for taken in VLM_FAMILIES) and "safetensors" in message
    if arch == "LlavaForConditionalGeneration":
        assert "clip_vision_model vision tower" in message


def test_a_remote_code_vlm_is_refused_as_one_the_check_has_no_reference_for(
    tmp_path: Path,
) -> None:
    """Kimi-VL: upstream writes its projector, transformers has no class to run it."""
    config = {"architectures": ["KimiVLForConditionalGeneration"], "model_type": "kimi_vl",
              "vision_config": {"model_type": "moonvit"}, "text_config": {}}  # fmt: skip
    spec = JobSpec.model_validate(
        {"source": "hf://org/model", "exports": [{"format": "gguf", "type": "q8_0"}]}
    )
    with pytest.raises(UnsupportedExport, match=r"\(kimivl\), but transformers has no class"):
        check_spec(spec, Settings(data_dir=tmp_path), config, config_known=True,
                   source_checked=True)  # fmt: skip
