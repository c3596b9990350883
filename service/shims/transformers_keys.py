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
