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

    from service.checkpoint.base import WeightReader

log = logging.getLogger(__name__)


def tied_targets_of_model(model: torch.nn.Module) -> set[str]:
    """Names a loader fills by tying: parameters/buffers sharing an object with an earlier name."""
    kept = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    every |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return every - kept


def tied_pairs_of_model(model: torch.nn.Module) -> dict[str, str]:
    """Every tied name -> the name ``named_parameters()`` keeps for the same parameter."""
    kept: dict[int, str] = {}
    for name, param in model.named_parameters():
        kept[id(param)] = name
    return {
        name: kept[id(param)]
        for name, param in model.named_parameters(remove_duplicate=False)
        if kept.get(id(param), name) != name
    }


def resolve_ties(reader: WeightReader, config: Mapping[str, Any] | None) -> dict[str, str]:
    """Make both names of every tie the config implies readable, whichever one the file holds.

    ``save_pretrained`` stores a tied embedding under the input name, ``safetensors.torch.
    save_model`` under the output name, some converters under both. Resolving it here, once,
    means every exporter sees the same names whatever the layout, instead of each one guessing.
    Returns the aliases added (alias -> stored name). Untied configs add nothing, so an untied
    model missing its ``lm_head.weight`` stays incomplete (and is reported so), never silently
    tied.
    """
    if not config or not config.get("architectures"):
        return {}
    stored = {info.name for info in reader.tensor_infos()} | set(reader.aliases())
    pairs = tied_pairs_from_config(config)
    if not pairs:
        return {}
    added: dict[str, str] = {}
    for target, source in sorted(pairs.items()):
        for missing, present in ((target, source), (source, target)):
            if missing not in stored and present in stored:
                present = reader.aliases().get(present, present)
                reader.add_alias(missing, present)
                added[missing] = present
                stored.add(missing)
    if added:
        log.info("tied weights served under both names: %s", added)
    return added


def tied_pairs_from_config(config: Mapping[str, Any] | None) -> dict[str, str] | None:
    """:func:`tied_pairs_of_model` of the model ``config`` describes, built on ``meta``."""
    model = _meta_model(config)
    return None if model is None else tied_pairs_of_model(model)


def tied_targets_from_config(config: Mapping[str, Any] | None) -> set[str] | None:
    """Tied targets of the built-in transformers class named by ``config["architectures"][0]``.

    None when that cannot be known (no config, unknown or remote-code architecture); remote code
    is never executed here.
    """
    model = _meta_model(config)
    return None if model is None else tied_targets_of_model(model)


def _meta_model(config: Mapping[str, Any] | None) -> torch.nn.Module | None:
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
    assert isinstance(model, torch.nn.Module)
    return model
