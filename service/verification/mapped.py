"""Modules of transformers' model read from the published safetensors file instead of loaded:
the stand-ins that keep the independent reference (:mod:`service.verification.independent`)
below a layer, a vocabulary or a projection.

* :class:`MappedEmbedding`: the input embedding's rows of the input's token ids;
* :class:`MappedHead`: the output head, a block of vocabulary rows at a time;
* :class:`MappedLinear`: a projection of the layer stack larger than its block, a block of
  output rows at a time (module by module).

Each reads the memory-mapped file with the ``safetensors`` library in the stored dtype (plain
floats only: :data:`MAPPED_DTYPES`; FP8 and its scales stay transformers' to load) and upcasts
to float32 as the loaded module would have been cast. Apart from ``independent`` so that each
module stays within the house's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class StoredTensor:
    """A vocabulary-sized matrix where the published safetensors file holds it."""

    kind: str
    """``embedding`` (gathered by token id), ``head`` (multiplied a block of rows at a time) or
    ``linear`` (a projection of the layer stack, the same by :data:`LINEAR_BLOCK_BYTES`)."""
    file: Path
    key: str
    bias: tuple[Path, str] | None = None
    """A head's bias: its file and key."""


MAPPED_DTYPES = frozenset({"F32", "F16", "BF16"})
"""Stored dtypes read as they are (anything else, FP8 with its scales included, is left to
transformers' loader)."""
HEAD_BLOCK_BYTES = 16 << 20
"""float32 bytes of one block of head rows (:class:`MappedHead`)."""
LINEAR_BLOCK_BYTES = 64 << 20
"""Module by module, a projection larger than this in float32 is read from the file in blocks
of output rows of this many float32 bytes (:class:`MappedLinear`); a smaller one is loaded
whole by accelerate when it runs. A 70B MLP projection (28672 x 8192) is 0.88 GiB in float32,
an attention one 0.25 GiB."""


def weight_files(source_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    import json

    from safetensors import safe_open

    index = source_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: source_dir / file for name, file in weight_map.items()}
    single = source_dir / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def stored_as_floats(files: dict[str, Path], name: str, prefix: str) -> tuple[Path, str] | None:
    """Where the source stores tensor ``name`` (or the same without the model's
    ``base_model_prefix``) as plain floats (:data:`MAPPED_DTYPES`): its file and key."""
    from safetensors import safe_open

    for key in (name, name.removeprefix(prefix)):
        if key in files:
            with safe_open(str(files[key]), framework="pt") as f:
                if f.get_slice(key).get_dtype() in MAPPED_DTYPES:
                    return files[key], key
            return None
    return None


def mappable_linears(
    model: Any, stack: str, source_dir: Path, limit: int
) -> dict[str, StoredTensor]:
    """The plain ``nn.Linear`` modules under ``stack`` (a path ending in ``.``) larger than
    ``limit`` bytes in float32 whose weight (and bias) the source stores as plain floats."""
    files = weight_files(source_dir)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    found: dict[str, StoredTensor] = {}
    for path, module in model.named_modules():
        if not path.startswith(stack) or type(module) is not nn.Linear:
            continue
        if module.in_features * module.out_features * 4 <= limit:
            continue
        weight = stored_as_floats(files, f"{path}.weight", prefix)
        bias = stored_as_floats(files, f"{path}.bias", prefix) if module.bias is not None else None
        if weight is not None and (module.bias is None) == (bias is None):
            found[path] = StoredTensor("linear", *weight, bias=bias)
    return found


def mappable(model: Any, source_dir: Path) -> dict[str, StoredTensor]:
    """The input embedding (a plain ``nn.Embedding``) and output head (a plain ``nn.Linear``)
    of the meta ``model`` whose weights the source stores as plain floats: module path -> where
    (a tied head reads the embedding's rows)."""

    files = weight_files(source_dir)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    paths = {id(m): n for n, m in model.named_modules()}

    def stored(name: str) -> tuple[Path, str] | None:
        return stored_as_floats(files, name, prefix)

    found: dict[str, StoredTensor] = {}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    plain_embedding = type(embedding) is nn.Embedding and id(embedding) in paths
    plain_head = type(head) is nn.Linear and id(head) in paths
    embedding_at = stored(f"{paths[id(embedding)]}.weight") if plain_embedding else None
    head_at = stored(f"{paths[id(head)]}.weight") if plain_head else None
    if bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False)):
        # a tied pair is stored once, under either name (SmolLM2 under the embedding's; a
        # checkpoint saved from the head's side under ``lm_head.weight``): both read that one
        embedding_at, head_at = embedding_at or head_at, head_at or embedding_at
    if plain_embedding and embedding_at is not None:
        found[paths[id(embedding)]] = StoredTensor("embedding", *embedding_at)
    if plain_head and head_at is not None:
        path = paths[id(head)]
        bias = stored(f"{path}.bias") if head.bias is not None else None
        if (head.bias is None) == (bias is None):
            found[path] = StoredTensor("head", *head_at, bias=bias)
    return found


class MappedEmbedding(nn.Module):
    """Stands in for a plain ``nn.Embedding``: the rows of the input's token ids, read from the
    memory-mapped file in their stored dtype, cast to ``dtype`` as transformers casts the
    weight (the dtype of the module it stands in for, as loaded)."""

    def __init__(self, stored: StoredTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.stored, self.dtype = stored, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        unique, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        with safe_open(str(self.stored.file), framework="pt") as f:
            rows = f.get_slice(self.stored.key)
            gathered = torch.cat([rows[i : i + 1] for i in unique.tolist()])
        out = gathered.to(self.dtype)[inverse]
        return out.reshape(*input_ids.shape, out.shape[-1])


class MappedLinear(nn.Module):
    """Stands in for a plain ``nn.Linear``: its outputs a block of ``block_bytes`` of float32
    rows of the weight at a time, each block read from the memory-mapped file in its stored
    dtype and upcast to float32, as are the inputs (float32 outputs). Nothing of the weight
    stays resident between blocks."""

    def __init__(self, stored: StoredTensor, block_bytes: int) -> None:
        super().__init__()
        self.stored, self.block_bytes = stored, block_bytes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        h = hidden.float()
        with safe_open(str(self.stored.file), framework="pt") as f:
            rows = int(f.get_slice(self.stored.key).get_shape()[0])
        out = torch.empty(*hidden.shape[:-1], rows, dtype=torch.float32)
        step = max(1, self.block_bytes // (4 * hidden.shape[-1]))
        for start in range(0, rows, step):
            # The file is mapped afresh for each block: the pages a block touched leave the
            # process's resident set with it (the kernel's page cache may keep them, reclaimably).
            with safe_open(str(self.stored.file), framework="pt") as f:
                block = f.get_slice(self.stored.key)[start : start + step]
            out[..., start : start + step] = h @ block.float().T
        if self.stored.bias is not None:
            with safe_open(str(self.stored.bias[0]), framework="pt") as f:
                out += f.get_tensor(self.stored.bias[1]).float()
        return out


class MappedHead(MappedLinear):
    """Stands in for a plain ``nn.Linear`` output head: the logits of a block of
    :data:`HEAD_BLOCK_BYTES` of vocabulary rows at a time (:class:`MappedLinear`)."""

    def __init__(self, stored: StoredTensor) -> None:
        super().__init__(stored, HEAD_BLOCK_BYTES)


def replace_module(
    model: Any, path: str, stored: StoredTensor, block_bytes: int | None = None
) -> None:
    """Put the mapped stand-in where transformers' module (never loaded: on ``disk``) was."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    loaded = model.get_submodule(path).weight.dtype
    made: nn.Module
    if stored.kind == "embedding":
        made = MappedEmbedding(stored, loaded)
    elif stored.kind == "head":
        made = MappedHead(stored)
    else:
        made = MappedLinear(stored, LINEAR_BLOCK_BYTES if block_bytes is None else block_bytes)
    setattr(parent, name, made)
