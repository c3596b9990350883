"""Which tensor names a transformers model re-creates by tying, so an export may leave them out.

transformers' ``save_pretrained`` drops the *target* of each tie (``lm_head.weight`` tied to
``model.embed_tokens.weight``) and re-ties on load; keeping the wrong name of a pair silently
leaves the kept-by-loader weight randomly initialised. The authoritative answer is the model
itself: built on the ``meta`` device (no memory, milliseconds even for 70B), the names
``named_parameters()`` de-duplicates away are exactly the targets, honouring
``tie_word_embeddings`` in the config.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def tied_targets_of_model(model: torch.nn.Module) -> set[str]:
    """Names a loader fills by tying: parameters/buffers sharing an object with an earlier name."""
    kept = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    every |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return every - kept


def tied_targets_from_config(config: Mapping[str, Any] | None) -> set[str] | None:
    """Tied targets of the built-in transformers class named by ``config["architectures"][0]``.

    None when that cannot be known (no config, unknown or remote-code architecture); remote code
    is never executed here.
    """
    if not config:
        return None
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if not isinstance(archs, list) or not archs or not isinstance(model_type, str):
        return None
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_cls = CONFIG_MAPPING[model_type]
        model_cls = getattr(transformers, str(archs[0]))
        hf_config = config_cls.from_dict(dict(config))
        with torch.device("meta"):
            model = model_cls(hf_config)
    except (KeyError, AttributeError, ValueError, TypeError, ImportError, RuntimeError) as exc:
        log.info("cannot build %s on meta to find tied weights: %s", archs[0], exc)
        return None
    return tied_targets_of_model(model)
