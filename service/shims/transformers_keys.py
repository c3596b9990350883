"""transformers' own renaming of checkpoint keys to module names (``conversion_mapping``).

Why: transformers 5 loads the published VLM layouts (Gemma 3's ``language_model.model.*`` and
``vision_tower.vision_model.*``) into modules named ``model.language_model.*`` and
``model.vision_tower.*`` through per-model rename rules applied at ``from_pretrained``, not
through ``base_model_prefix``. The job's meta build matches checkpoint names to module names
itself (``service.offload.build.match_keys``), so it asks transformers for the same rules
rather than copying them.

What is used (checked on transformers 5.23; ``tests/unit/shims/test_transformers_keys.py``
names it): ``conversion_mapping.get_model_conversion_mapping(model)`` returning
``WeightRenaming`` and ``WeightConverter`` objects, and ``core_model_loading.rename_source_key(key,
renamings, converters)`` returning ``(new_key, matched_converter_pattern)``. Only pure renames
are used: a key a ``WeightConverter`` matches (fused or split tensors) is left as it is.

:func:`published_names` also uses ``get_model_conversion_mapping(model, add_legacy=False)`` and
each transform's ``reverse_transform()``, which is how ``revert_weight_conversion`` names what
``save_pretrained`` writes for a model ``from_pretrained`` loaded (``PrefixChange`` included:
such a model carries it in ``_weight_conversions``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def key_renamer(model: Any) -> Callable[[str], str]:
    """A function giving a checkpoint key as transformers' rename rules for ``model`` name it
    (the key itself when no rule applies, the installed transformers has none, or a converter
    would transform the tensor)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # a transformers without per-model rules: names are used as they are
        return lambda key: key
    rules = list(get_model_conversion_mapping(model) or [])
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    if not renamings:
        return lambda key: key

    def rename(key: str) -> str:
        renamed, converted = rename_source_key(key, renamings, converters)
        return key if converted is not None else str(renamed)

    return rename


def model_names(model: Any, names: list[str]) -> dict[str, str]:
    """Each checkpoint name -> the module name transformers' rules load it into (a key a
    converter transforms stays as it is)."""
    rename = key_renamer(model)
    return {name: rename(name) for name in names}


def published_names(model: Any, names: list[str]) -> dict[str, str]:
    """Each checkpoint name -> the same tensor in the published layout: read through
    transformers' rules into the module's name, then named as transformers writes a model it
    loaded from the Hub (its non-legacy rules reversed, ``PrefixChange`` included). Why: the
    layout ``save_pretrained`` writes for a model built by transformers 5 is not always the one
    llama.cpp's converter reads (Gemma 3's ``vision_tower.embeddings.*``, where the Hub and a
    re-saved Hub model have ``vision_tower.vision_model.*``); one canonical layout, found by
    transformers' own rules, serves every layout those rules read. A name the reversed rules do
    not bring back to the same module name, or that a converter transforms, stays as stored."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without per-model rules: names are used as they are
        return {name: name for name in names}
    forward = model_names(model, names)
    saving = list(get_model_conversion_mapping(model, add_legacy=False) or [])
    reverse = [r.reverse_transform() for r in saving[::-1]]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    if not renamings:
        return {name: name for name in names}
    rename = key_renamer(model)
    out = {}
    for name in names:
        published = str(rename_source_key(forward[name], renamings, [])[0])
        out[name] = published if rename(published) == forward[name] else name
    return out


def unloadable_names(model: Any, names: list[str]) -> list[str]:
    """The checkpoint names transformers' rules load into none of ``model``'s tensors (neither
    renamed onto one nor taken by a converter): a layout transformers itself cannot read."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        converters: list[Any] = []
    else:
        rules = list(get_model_conversion_mapping(model) or [])
        converters = [r for r in rules if isinstance(r, WeightConverter)]
    wanted = set(model.state_dict())
    rename = key_renamer(model)
    out = []
    for name in names:
        if rename(name) in wanted:
            continue
        if converters and rename_source_key(name, [], converters)[1] is not None:
            continue
        out.append(name)
    return out
