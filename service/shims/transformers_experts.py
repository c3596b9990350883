"""transformers' own conversion between a MoE's per-expert tensors and its packed expert stacks.

Why: transformers 5 builds Mixtral, Qwen2-MoE, Qwen3-MoE (and every family its registry maps
to them: DeepSeek, GLM-4 MoE, OLMoE...) with one tensor per projection for all of a layer's
experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``),
while the Hub's checkpoints, and ``save_pretrained`` unless told otherwise, hold one tensor per
expert (``block_sparse_moe.experts.3.w1.weight``, ``mlp.experts.3.gate_proj.weight``).
``from_pretrained`` converts while it loads, with the family's ``WeightConverter``s; the job
reads tensors itself, one expert at a time, so it asks transformers which keys go into which
stack, in which order and along which dimension, and reads the stack as a layout
(``service.checkpoint.experts``), never holding a layer's experts at once.

What is used (checked on transformers 5.23; ``tests/unit/shims/test_transformers_experts.py``
names each assumption):

* ``conversion_mapping.get_model_conversion_mapping(model)``: the model's ``WeightRenaming``s
  and ``WeightConverter``s, as ``from_pretrained`` collects them;
* ``core_model_loading.rename_source_key(key, renamings, converters)`` -> ``(name, matched
  source pattern or None)``: the name a checkpoint key loads into;
* ``core_model_loading.dot_natural_key``: the order ``from_pretrained`` collects a pattern's
  tensors in, hence the experts' order in the stack;
* a converter whose ``operations`` are ``[MergeModulelist(dim=0)]`` or
  ``[MergeModulelist(dim=0), Concatenate(dim=d)]`` computes ``torch.cat([torch.stack(experts
  of pattern p) for p in source_patterns], dim=d)``; other converters (fused qkv, transposes,
  quantizers) are not read as layouts, and their keys are left as they are;
* ``core_model_loading.revert_weight_conversion(model, state_dict)``: the names
  ``save_pretrained`` writes for a packed model (run on meta tensors: no data).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CHECKED_ON = "5.23"
"""The transformers release this adapter was checked on (``pyproject.toml`` caps below the next)."""


@dataclass(frozen=True)
class ExpertStack:
    """One packed tensor of a MoE layer and the per-expert tensors it is made of.

    ``packed = cat([stack(parts[p]) for p in patterns], dim=concat_dim)``: ``parts[p][e]`` is
    expert ``e``'s tensor of the converter's ``p``-th source pattern (Mixtral's gate_up_proj:
    ``w1`` then ``w3``, each ``[I, H]``, joined along dimension 1 of ``[E, 2I, H]``).
    """

    packed: str
    parts: tuple[tuple[str, ...], ...]
    """``[pattern][expert]`` -> the per-expert tensor's name."""
    concat_dim: int = 1
    """Dimension of the packed tensor the patterns are joined along (1 with one pattern)."""

    @property
    def experts(self) -> int:
        return len(self.parts[0])

    def names(self) -> list[str]:
        """Every per-expert name, expert by expert (the Hub's order)."""
        return [p[e] for e in range(self.experts) for p in self.parts]


@dataclass(frozen=True)
class ExpertConversion:
    """How one layout of a checkpoint's names becomes the other, as transformers converts it.

    ``packs``: the reader stores experts one by one and the stacks are to be served packed;
    otherwise the reader stores the stacks and their parts are to be served.
    """

    packs: bool
    stacks: tuple[ExpertStack, ...]
    renamed: dict[str, str] = field(default_factory=dict)
    """Name stored -> name served, for the other tensors transformers renames on the way
    (Mixtral's router: ``block_sparse_moe.gate`` <-> ``mlp.gate``)."""


def _transformers() -> Any | None:
    """transformers' loading internals, or None on a transformers without them (4.x: its MoE
    modules hold one tensor per expert, as the Hub's checkpoints do; nothing to convert)."""
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError:
        return None
    return (conversion_mapping, core_model_loading)


def _concat_dim(converter: Any, loading: Any) -> int | None:
    """The dimension a supported expert-packing converter joins its patterns along, or None
    when its operations are not a stack of experts (optionally concatenated)."""
    ops = list(getattr(converter, "operations", []) or [])
    if not ops or type(ops[0]) is not loading.MergeModulelist or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return 1 if len(converter.source_patterns) == 1 else None
    if len(ops) == 2 and type(ops[1]) is loading.Concatenate and ops[1].dim >= 1:
        return int(ops[1].dim)
    return None


def _rules(model: Any) -> tuple[list[Any], list[Any], Any] | None:
    """(renamings, expert-packing converters, core_model_loading) for ``model``, or None."""
    found = _transformers()
    if found is None:
        return None
    mapping, loading = found
    rules = list(mapping.get_model_conversion_mapping(model) or [])
    renamings = [r for r in rules if isinstance(r, loading.WeightRenaming)]
    converters = [
        r for r in rules
        if isinstance(r, loading.WeightConverter) and _concat_dim(r, loading) is not None
    ]  # fmt: skip
    if not converters:
        return None
    return renamings, converters, loading


def packing(model: Any, names: Iterable[str]) -> ExpertConversion | None:
    """The stacks ``model`` (built by transformers) packs the per-expert tensors ``names`` into,
    with every other name as ``from_pretrained`` renames it; None when none of ``names`` is a
    per-expert tensor of a stack the model has."""
    rules = _rules(model)
    if rules is None:
        return None
    renamings, converters, loading = rules
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, dict[str, list[str]]] = {}
    owner: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    for name in sorted(names, key=loading.dot_natural_key):
        target, pattern = loading.rename_source_key(name, renamings, converters)
        if pattern is None:
            if target != name:
                renamed[name] = str(target)
            continue
        groups.setdefault(target, {}).setdefault(pattern, []).append(name)
        owner[target] = by_pattern[pattern]
    stacks = []
    for target, members in groups.items():
        converter = owner[target]
        parts = tuple(tuple(members.get(p, ())) for p in converter.source_patterns)
        if not parts[0] or any(len(p) != len(parts[0]) for p in parts):
            continue  # an incomplete stack stays as stored: the build names what is missing
        stacks.append(ExpertStack(target, parts, _concat_dim(converter, loading) or 1))
    if not stacks:
        return None
    return ExpertConversion(packs=True, stacks=tuple(stacks), renamed=renamed)


def unpacking(model: Any, shapes: Mapping[str, tuple[int, ...]]) -> ExpertConversion | None:
    """The per-expert tensors ``save_pretrained`` would write for the packed stacks among
    ``shapes`` (name -> shape of each stored tensor), with every other name as it would write
    it; None when no stored tensor is a stack ``model`` packs."""
    rules = _rules(model)
    if rules is None:
        return None
    import torch

    _, _, loading = rules
    meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    saved = list(loading.revert_weight_conversion(model, meta))
    back = packing(model, saved)  # which saved names make which stored stack, in order
    if back is None:
        return None
    stacks = tuple(s for s in back.stacks if s.packed in shapes)
    if not stacks:
        return None
    parts = {n for s in stacks for n in s.names()}
    renamed = {
        stored: n
        for n in saved
        if n not in parts and (stored := back.renamed.get(n, n)) != n and stored in shapes
    }
    return ExpertConversion(packs=False, stacks=stacks, renamed=renamed)
