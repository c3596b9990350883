"""Whether a checkpoint is a vision-language model, and which of its tensors are the vision part.

A VLM's config has a ``vision_config`` beside its text model; transformers writes the vision
tower and the projector under the prefixes of :data:`VISION_PREFIXES` (SigLIP under Gemma 3's
``vision_tower.vision_model.*``, Idefics3's ``model.vision_model.*`` and ``model.connector.*``,
Qwen2-VL's ``visual.*``). The GGUF exporter writes those tensors into the ``mmproj`` file and the
plan counts them apart (the projector file, the transformers reference of the whole model); no
torch here, the API process judges a config at submission.
"""

from __future__ import annotations

from typing import Any

VISION_PREFIXES = (
    "vision_tower.",
    "vision_model.",
    "model.vision_tower.",
    "model.vision_model.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "visual.",
    "model.visual.",
    "model.connector.",
    "connector.",
)
"""Where the VLMs transformers writes keep their vision tower and projector."""


def is_multimodal(config: dict[str, Any] | None) -> bool:
    """Whether the config describes a vision-language model (it has a ``vision_config``)."""
    return isinstance((config or {}).get("vision_config"), dict)


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower or the projector."""
    return name.startswith(VISION_PREFIXES)
