"""A vision-language model's multimodal projector (``mmproj-*.gguf``), planned by llama.cpp.

A VLM in llama.cpp is two files: the text model (``layout_gguf``, upstream's text class, which
drops the vision tensors) and the projector that ``llama-mtmd-cli`` / ``llama-server --mmproj``
load beside it: the vision tower, the projector and the ``clip.*`` keys (image size, patch size,
mean/std, projector type). Upstream's ``convert_hf_to_gguf.py --mmproj`` writes it with the
architecture's ``MmprojModel`` subclass (``MMPROJ_MODEL_MAP``); here the same class is run
through ``service.shims.llama_cpp_convert.plan_conversion(mmproj=True)`` on lazy tensors fed
by the job's reader, and the file is written by the same streaming writer as the text model, so
the vision tower is read tensor by tensor in row blocks, never whole.

The projector is ``f16`` beside every text type but ``f32`` (which keeps ``f32``): the
projectors ggml-org publishes beside its quantized text models are f16, and a ``q8_0`` one
(upstream's ``--outtype q8_0``) moved the first image-conditioned token of the tiny Qwen2.5-VL,
Qwen3-VL-MoE, GLM-4.1V and Pixtral models by logit leads of 0.45-1.16, where a q8_0 text
model beside an f16 projector stayed within near ties: a projector's error reaches every image
token, and its type is not what a user asks a text type for. llama-quantize's types are made
from the f16 text model; llama.cpp does not quantize a projector with them either.

llama.cpp #22656: a converter class whose name filter matched nothing wrote a ~1 KB projector
with the keys and no tower, which loads and then fails at the first image. :func:`check_tower`
refuses a plan that does not hold every block of the vision tower and at least half of the
checkpoint's vision bytes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.checkpoint.vision import is_multimodal, is_vision_tensor
from service.errors import ExportFailed, UnsupportedExport
from service.exporters.gguf.layout import FILE_TYPES, GGUFPlan, OutType, writer_tensor

if TYPE_CHECKING:
    from service.checkpoint.base import WeightReader

MMPROJ_PREFIX = "mmproj-"
"""File name prefix of a projector (``convert_hf_to_gguf.py --mmproj`` adds the same)."""


MTMD_ON_F16 = frozenset({"q8_0", "q4_0"})
"""Text types our writer quantizes whose mtmd check runs on an f16 text file of the same
checkpoint written for it to the work dir (as a llama-quantize type's runs on the f16 file it
was made from): 8-bit blocks moved the tiny models' greedy tokens from transformers' at leads
up to 0.45 (Qwen2.5-VL), so their own greedy text proves nothing about the projector, and
after such a tie their byte tokens often cannot be fed back to compare teacher-forced. The
quantized text model is judged by the text checks (``llama_check``); the projector and the
image's place in the sequence, which the mtmd check is for, are the same files either way."""


def mmproj_type(text_type: str) -> OutType:
    """The projector's storage type for a text model of ``text_type`` (see the module doc)."""
    return "f32" if text_type.lower() == "f32" else "f16"


VLM_FAMILIES: dict[str, str] = {
    "Idefics3ForConditionalGeneration": "SmolVLM / Idefics3",
    "SmolVLMForConditionalGeneration": "SmolVLM2",
    "Qwen2VLForConditionalGeneration": "Qwen2-VL",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE",
    "LlavaForConditionalGeneration": "Pixtral: LLaVA with a Pixtral tower",
    "Mistral3ForConditionalGeneration": "Mistral Small 3.1 / 3.2",
    "JanusForConditionalGeneration": "Janus-Pro",
    "Glm4vForConditionalGeneration": "GLM-4.1V",
    "Gemma4ForConditionalGeneration": "Gemma 4",
}
"""The vision-language models a GGUF export takes (by the architecture upstream's ``--mmproj``
dispatches on): those whose projector the job checks with llama-mtmd-cli against transformers
(``mtmd_check.LAYOUTS`` holds each one's sequence layout), each tested on a tiny model of the
real class (``tests/fixtures/vlm.py``). Every other VLM is refused at submission
(:func:`check_vlm`), rather than written with a projector nothing checked."""


VLM_TOWERS: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": ("pixtral",),
    "Mistral3ForConditionalGeneration": ("pixtral",),
}
"""Families whose upstream projector class takes only some vision towers
(``vision_config.model_type``): ``LlavaVisionModel`` raises on any tower but Pixtral's (a CLIP
LLaVA 1.5/1.6 among them), so those are refused at submission, not at the converter."""


RUNTIME_DIFFERS: dict[str, str] = {
    "Gemma3ForConditionalGeneration": (
        "llama.cpp's mtmd prompts it with another sequence than its reference processor: it "
        "writes an image as <start_of_image>, the soft tokens, <end_of_image> (llama.cpp "
        "tools/mtmd/mtmd.cpp, PROJECTOR_TYPE_GEMMA3: img_beg/img_end), while transformers' "
        "Gemma3Processor writes \\n\\n<start_of_image>, the soft tokens, <end_of_image>\\n\\n "
        "(transformers models/gemma3/processing_gemma3.py, full_image_sequence), so llama.cpp's "
        "replies to the same user prompt differ from transformers' (given one sequence, both "
        "run the model alike, the image's bidirectional attention included)"
    ),
}
"""Families upstream converts and the check could run, whose llama.cpp runtime differs from
the reference implementation (the job must not pass them: refused at submission, the upstream
references in the message). Gemma 3: on a tiny model whose greedy output tells causal from
bidirectional image attention, llama-mtmd-cli agreed with transformers given llama.cpp's own
sequence (8 tokens, then a near tie; forced causal, transformers parts at token 1 with a lead
of 0.11), and parted from transformers fed by its processor at token 1 (image in a chat turn)
and 2 (image first)."""


NOT_TAKEN_WHY: dict[str, str] = {
    "Llama4ForConditionalGeneration": (
        "transformers' Llama 4 image processor needs torchvision, which the service does not "
        "install, so the check would have no reference"
    ),
    "Lfm2VlForConditionalGeneration": (
        "transformers' LFM2-VL image processor needs torchvision, which the service does not "
        "install, so the check would have no reference"
    ),
    "Gemma3nForConditionalGeneration": (
        "its MobileNetV5 vision tower is a timm model, which the service does not install, so "
        "the check would have no reference"
    ),
}
NOT_TAKEN_WHY |= RUNTIME_DIFFERS
"""Why a family upstream writes a projector for is not taken, where it is known beyond "not
checked here yet" (see also :func:`check_vlm`'s remote-code case)."""


def check_vlm(config: dict[str, Any], bin_dir: Path | None = None) -> None:
    """Refuse a vision-language model outside :data:`VLM_FAMILIES` with
    :class:`UnsupportedExport` naming the ones taken and why this one is not."""
    from service.shims.llama_cpp_convert import (
        mmproj_architecture as upstream_arch,
    )
    from service.shims.llama_cpp_convert import (
        supported_mmproj_architectures,
    )

    if not is_multimodal(config):
        return
    arch = upstream_arch(config) or "a model without architectures"
    upstream = supported_mmproj_architectures(bin_dir)
    tower = (config.get("vision_config") or {}).get("model_type")
    towers = VLM_TOWERS.get(arch)
    tower_taken = towers is None or tower in towers
    if arch in VLM_FAMILIES and arch in upstream and tower_taken:
        return
    if arch not in upstream:
        why = "llama.cpp's converter writes no projector for it"
    elif not tower_taken:
        why = (
            f"llama.cpp's converter writes its projector ({upstream[arch]}) for "
            f"{' or '.join(towers or ())} vision towers only"
        )
    else:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT_TO_TEXT,
        )

        if arch in NOT_TAKEN_WHY:
            reason = NOT_TAKEN_WHY[arch]
        elif arch not in set(IMAGE_TEXT_TO_TEXT.values()):
            reason = (
                "transformers has no class for it (its checkpoints run remote code), so the "
                "check would have no reference"
            )
        else:
            reason = "its projector is not one this service checks yet"
        why = (
            f"llama.cpp's converter has a projector class for it ({upstream[arch]}), but "
            f"{reason} (the check runs llama-mtmd-cli against transformers)"
        )
    taken = ", ".join(f"{a} ({n})" for a, n in VLM_FAMILIES.items())
    raise UnsupportedExport(
        f"GGUF export takes text models and the vision-language models {taken}, not {arch}"
        f"{f' with a {tower} vision tower' if tower else ''}: {why}; a VLM of any family "
        "exports as safetensors (every sub-model and the processor files)"
    )


def check_layout(config: dict[str, Any], root: Path) -> None:
    """Refuse a VLM checkpoint whose tensor names transformers' own rules do not load (the
    names llama.cpp's converter is handed are found through them:
    ``shims.llama_cpp_convert.published_layout``), with :class:`UnsupportedExport` naming some.
    Every layout transformers reads passes: the Hub's, and what ``save_pretrained`` writes."""
    if not is_multimodal(config):
        return
    from transformers import AutoConfig

    from service.checkpoint.headers import local_file_header

    names = [t.name for f in sorted(root.glob("*.safetensors")) for t in local_file_header(f)]
    if not names:
        return  # a pickle checkpoint: its reader names what it holds
    _check_names(config, names, AutoConfig.from_pretrained(str(root), local_files_only=True))


def check_layout_of_names(config: dict[str, Any], names: list[str]) -> None:
    """:func:`check_layout` from a remote source's headers (its config.json and its
    safetensors headers' names), at submission, before the download."""
    if not is_multimodal(config) or not names or "model_type" not in config:
        return
    from transformers import AutoConfig

    rest = {k: v for k, v in config.items() if k != "model_type"}
    _check_names(config, names, AutoConfig.for_model(str(config["model_type"]), **rest))


def _check_names(config: dict[str, Any], names: list[str], hf_config: Any) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from service.shims.transformers_keys import unloadable_names

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf_config)  # type: ignore[no-untyped-call]
    unread = unloadable_names(model, names)
    if unread:
        arch = (config.get("architectures") or ["?"])[0]
        raise UnsupportedExport(
            f"GGUF export of {arch}: {len(unread)} of the checkpoint's {len(names)} tensors "
            f"(e.g. {unread[:3]}) are in a layout transformers' own rules for {arch} do not "
            "load, so llama.cpp's converter cannot be handed them under the published names; "
            "save the model with transformers' save_pretrained, or use the published layout"
        )


def plan_mmproj(
    root: Path,
    config: dict[str, Any],
    reader: WeightReader,
    out_type: OutType,
    *,
    bin_dir: Path | None = None,
    metadata: bool = True,
) -> GGUFPlan:
    """What upstream's ``MmprojModel`` class writes for this checkpoint, as the writer's plan."""
    import gguf

    from service.shims.llama_cpp_convert import plan_conversion

    conversion = plan_conversion(
        root, config, reader, out_type, bin_dir=bin_dir, metadata=metadata, vocab=False,
        mmproj=True,
    )  # fmt: skip
    aliases = reader.aliases()
    itemsize = {info.name: info.dtype.itemsize for info in reader.tensor_infos()}
    tensors = []
    for t in conversion.tensors:
        tensors.append(writer_tensor(t, t.ggml_type, aliases, itemsize, ExportFailed))
    return GGUFPlan(
        arch_name=conversion.arch_name,
        hf_architecture=conversion.hf_architecture,
        converter_class=conversion.model_class,
        out_type=out_type,
        file_type=int(gguf.LlamaFileType[FILE_TYPES[out_type]]),
        tensors=tuple(tensors),
        skipped=tuple(conversion.unused),
        metadata=tuple(conversion.metadata),
    )


def vision_tensors(reader: WeightReader) -> dict[str, int]:
    """The checkpoint's vision tower and projector tensors: name -> bytes."""
    return {
        info.name: int(info.nbytes)
        for info in reader.tensor_infos()
        if is_vision_tensor(info.name)
    }


def check_tower(plan: GGUFPlan, reader: WeightReader, config: dict[str, Any]) -> dict[str, Any]:
    """Refuse a projector without its vision tower (llama.cpp #22656); returns the figures.

    Every block of the vision config (``v.blk.<i>``) must be in the plan, and the plan must
    hold at least half of the checkpoint's vision bytes at the plan's storage width (an f16
    projector of a bfloat16 tower is the same size; q8_0 is ~53%)."""
    vision = config.get("vision_config") or {}
    layers = next(
        (int(vision[k]) for k in ("num_hidden_layers", "depth", "num_layers") if k in vision), 0
    )
    blocks = {int(m.group(1)) for t in plan.tensors if (m := re.match(r"v\.blk\.(\d+)\.", t.name))}
    missing = sorted(set(range(layers)) - blocks)
    source = vision_tensors(reader)
    source_bytes = sum(source.values())
    planned = plan.data_bytes
    if missing or source_bytes == 0 or planned * 2 < source_bytes * 0.5:
        raise ExportFailed(
            f"llama.cpp's {plan.converter_class} planned a projector without its vision tower "
            f"(llama.cpp #22656): {len(plan.tensors)} tensors, {planned} bytes for "
            f"{len(source)} vision tensors of {source_bytes} bytes in the checkpoint; "
            f"vision blocks missing: {missing[:8]}"
        )
    return {
        "vision_blocks": len(blocks),
        "vision_tensors_in_checkpoint": len(source),
        "vision_bytes_in_checkpoint": source_bytes,
        "mmproj_tensor_bytes": planned,
    }
