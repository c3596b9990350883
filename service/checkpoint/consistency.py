"""Does config.json describe the weights next to it? Checked from names and shapes alone.

A config that disagrees with its weights (4000 layers or a hidden size of 65536 on top of a
135M checkpoint) is a bad input, and a costly one: building 4000 layers on ``meta`` takes a
minute before dispatch notices the missing tensors, and a state-dict-level export that never
builds the model (GGUF) would write the config's numbers into its metadata beside the real
tensors, an artifact no runtime can load. So the job checks at READ, from the tensor index it
has anyway, and the API at submission for a local source, from the safetensors headers (a
few kilobytes, no torch): the number of layers the weights hold, and the input embedding's
shape against ``vocab_size`` and the hidden size. Only what the weights show for certain is
judged: no layer-indexed tensors, or no recognisable embedding, and the check says nothing.

This module imports nothing heavy: the API process calls it.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from service.errors import ConfigMismatch

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim")
EMBEDDING_WIDTH_KEYS = ("embedding_size", "word_embed_proj_dim")
"""Models whose input embedding is narrower than the hidden size say so (ALBERT, OPT-350m)."""
EMBEDDING_SUFFIXES = (
    "embed_tokens.weight",
    "word_embeddings.weight",
    "wte.weight",
    "tok_embeddings.weight",
)
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block))\.(\d+)\.")
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _int_key(config: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, int] | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def layer_stacks(names: Sequence[str]) -> dict[str, int]:
    """Each stack of numbered layers (``model.layers``, ``encoder.layer``...) -> how many layers
    the weights hold in it (highest index + 1)."""
    stacks: dict[str, int] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            stack, index = match.group(1), int(match.group(2))
            stacks[stack] = max(stacks.get(stack, 0), index + 1)
    return stacks


def check_config_matches_weights(
    config: Mapping[str, Any] | None, shapes: Mapping[str, Sequence[int]]
) -> None:
    """Raise :class:`ConfigMismatch` when ``config`` promises layers or dimensions that the
    weights (``shapes``: tensor name -> shape) do not have, naming the key and the tensor."""
    if not config or not shapes:
        return
    layers = _int_key(config, LAYER_COUNT_KEYS)
    stacks = layer_stacks(list(shapes))
    if layers is not None and stacks:
        key, wanted = layers
        stack, held = max(stacks.items(), key=lambda item: item[1])
        if wanted > held:
            raise ConfigMismatch(
                f"config.json and the weights disagree: {key} is {wanted}, but the weights hold "
                f"{held} layer(s) ({stack}.0 to {stack}.{held - 1})"
            )
    embedding = next(
        (n for n in shapes if n.endswith(EMBEDDING_SUFFIXES) and len(shapes[n]) == 2), None
    )
    if embedding is None and len(shapes.get("lm_head.weight", ())) == 2:
        embedding = "lm_head.weight"  # a tied embedding stored under the output name only
    if embedding is None:
        return
    rows, width = (int(d) for d in shapes[embedding])
    vocab = _int_key(config, ("vocab_size",))
    if vocab is not None and vocab[1] != rows:
        raise ConfigMismatch(
            f"config.json and the weights disagree: vocab_size is {vocab[1]}, but {embedding} "
            f"has {rows} rows (shape {[rows, width]})"
        )
    hidden = _int_key(config, EMBEDDING_WIDTH_KEYS) or _int_key(config, HIDDEN_KEYS)
    if hidden is not None and hidden[1] != width:
        raise ConfigMismatch(
            f"config.json and the weights disagree: {hidden[0]} is {hidden[1]}, but {embedding} "
            f"is {width} wide (shape {[rows, width]})"
        )


def safetensors_shapes(checkpoint_dir: Path) -> dict[str, list[int]] | None:
    """Tensor name -> shape from the safetensors headers of a local checkpoint directory, or None
    when that cannot be read cheaply and for sure (no safetensors, an odd header): the job's
    READ phase then judges with its own strict reader, which names any corruption."""
    tensors = safetensors_tensors(checkpoint_dir)
    return None if tensors is None else {n: shape for n, (_, shape) in tensors.items()}


def _safetensors_files(checkpoint_dir: Path) -> list[Path] | None:
    """The safetensors files of a local checkpoint directory (its index's, or the single
    ``model.safetensors``), or None: no safetensors, an odd index, a file outside the directory."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            return None
        files = sorted({str(f) for f in weight_map.values()})
    elif (checkpoint_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    root = checkpoint_dir.resolve()
    paths = [(checkpoint_dir / fname).resolve() for fname in files]
    return None if any(not p.is_relative_to(root) for p in paths) else paths


def safetensors_tensors(checkpoint_dir: Path) -> dict[str, tuple[str, list[int]]] | None:
    """Tensor name -> (header dtype such as ``"BF16"``, shape) from the safetensors headers of a
    local checkpoint directory, or None as :func:`safetensors_shapes` says."""
    try:
        files = _safetensors_files(checkpoint_dir)
        if files is None:
            return None
        tensors: dict[str, tuple[str, list[int]]] = {}
        for path in files:
            tensors.update(_header_tensors(path))
        return tensors
    except (OSError, ValueError, RecursionError, struct.error, AttributeError, TypeError):
        return None


def safetensors_weight_bytes(checkpoint_dir: Path) -> int | None:
    """Bytes of tensor data in a local checkpoint's safetensors files (each file's size less its
    header), read from the headers' lengths alone; None as :func:`safetensors_shapes` says."""
    try:
        files = _safetensors_files(checkpoint_dir)
        if files is None:
            return None
        total = 0
        for path in files:
            with path.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
            total += path.stat().st_size - 8 - length
        return total
    except (OSError, ValueError, struct.error, AttributeError, TypeError):
        return None


def _header_tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError("header too large")
        header = json.loads(handle.read(length))
    return {
        name: (str(entry["dtype"]), [int(d) for d in entry["shape"]])
        for name, entry in header.items()
        if name != "__metadata__"
    }
