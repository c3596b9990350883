"""Open a local checkpoint (directory or single weights file) as a :class:`Checkpoint`.

Which files are the weights, in order of preference (safetensors wins over pickles because it
needs no unpickling and can be referenced in place):

1. ``model.safetensors.index.json`` / ``model.safetensors``, then any other ``*.safetensors``
   index or files;
2. ``pytorch_model.bin.index.json`` / ``pytorch_model.bin``, then any other ``.bin``/``.pt``/
   ``.pth`` index or files, except well-known trainer state (``training_args.bin``...).

Files that travel with the weights (config, generation config, tokenizer) are collected as
``aux_files``; ``config.json`` is parsed into ``Checkpoint.config`` when it is a JSON object.

The readers (``checkpoint.safetensors``, ``checkpoint.torch_pickle``) import torch, so they are
imported by :func:`open_checkpoint`, not here: the API process imports this package for its
types and never opens a checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Literal

from service.checkpoint.base import Checkpoint, FileRegion, TensorInfo, WeightReader
from service.checkpoint.consistency import check_config_matches_weights
from service.checkpoint.index import ShardIndex, check_index_matches, load_index
from service.errors import CheckpointError, NoWeightFiles, SourceNotFound

__all__ = [
    "AUX_PATTERNS",
    "Checkpoint",
    "FileRegion",
    "TensorInfo",
    "WeightReader",
    "open_checkpoint",
    "weight_files",
]

AUX_PATTERNS = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "*.tiktoken",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "adapter_config.json",
)
"""Files that travel with the weights (exports carry them over), top level only, as fnmatch
patterns. The one list: a hub download fetches exactly these (service/sources/hub.py) and
open_checkpoint hands exactly these to the exporters, so nothing downloaded is dropped.
``adapter_config.json`` is here so that a job's ``adapter`` (``checkpoint.lora``), fetched like a
source, arrives with its config beside ``adapter_model.safetensors``."""


def aux_files_in(root: Path) -> list[Path]:
    """The auxiliary files at the top of checkpoint directory ``root``, sorted by name."""
    return sorted(
        p for p in root.iterdir()
        if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in AUX_PATTERNS)
        and p.name != "adapter_config.json"  # beside full weights it would make them an adapter
    )  # fmt: skip


Format = Literal["safetensors", "pickle"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
NOT_WEIGHTS = frozenset(
    {"training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt"}
)


def open_checkpoint(path: Path) -> Checkpoint:
    """Open the checkpoint at ``path``; headers and indexes are validated now, data read later.

    Raises :class:`NoWeightFiles` when there are no weights, :class:`MissingShard` when an index
    names an absent shard, :class:`CorruptCheckpoint` for truncated or lying files and
    :class:`UnsafePickle` for pickles holding arbitrary objects, :class:`ConfigMismatch` when
    config.json promises layers or dimensions the weights lack. A tie the config implies is
    readable under both names, whichever one the files hold (``checkpoint.ties``).
    """
    from service.checkpoint.safetensors import SafetensorsReader
    from service.checkpoint.ties import resolve_ties
    from service.checkpoint.torch_pickle import PickleReader

    if not path.exists():
        raise SourceNotFound(f"checkpoint path {path} does not exist")
    root = path if path.is_dir() else path.parent
    fmt, files, index = _weight_files(path)
    stored_reader: SafetensorsReader | PickleReader
    if fmt == "safetensors":
        stored_reader = SafetensorsReader(files)
    else:
        stored_reader = PickleReader(files)
    reader: WeightReader = stored_reader
    config = _load_config(root / "config.json")
    try:
        if index is not None:
            stored = {i.name: i.file for i in stored_reader.tensor_infos()}
            stored.update({a: stored[c] for a, c in stored_reader.aliases().items()})
            check_index_matches(index, stored)
        reader, config, quantization = _read_quantized(stored_reader, config)
        # Before anything is built on the config's word (resolve_ties below builds on meta).
        check_config_matches_weights(config, {i.name: i.shape for i in reader.tensor_infos()})
    except CheckpointError:
        stored_reader.close()
        raise
    aux = aux_files_in(root)
    resolve_ties(reader, config)  # after the index check: an index lists stored names only
    return Checkpoint(
        root=root,
        format=fmt,
        weight_files=files,
        reader=reader,
        config=config,
        aux_files=aux,
        quantization=quantization,
    )


def weight_files(path: Path) -> tuple[Format, list[Path]]:
    """(format, files) of the weights :func:`open_checkpoint` would read at ``path``, chosen
    from names and indexes alone (no torch): what a plan reads the headers of."""
    fmt, files, _ = _weight_files(path)
    return fmt, files


def _read_quantized(
    reader: WeightReader, config: dict[str, object] | None
) -> tuple[WeightReader, dict[str, object] | None, dict[str, object] | None]:
    """(reader, config, manifest record) once config.json's ``quantization_config`` is judged
    against the tensors (``checkpoint.quantization``): FP8 weights dequantized while read, a
    contradicted config dropped, anything else refused with :class:`UnsupportedQuantization`."""
    import torch

    from service.checkpoint.fp8 import Fp8DequantReader
    from service.checkpoint.quantization import plan_quantization, without_quantization
    from service.checkpoint.safetensors import DTYPE_NAMES

    tensors = {
        i.name: (DTYPE_NAMES.get(i.dtype, str(i.dtype)), i.shape) for i in reader.tensor_infos()
    }
    plan = plan_quantization(config, tensors)
    if plan.handling == "none":
        return reader, config, None
    record = plan.record()
    if plan.handling == "dequantize" and plan.block_size is not None and record is not None:
        # The model's dtype, as transformers' from_pretrained(dtype="auto") dequantizes into.
        name = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.bfloat16  # what FP8 checkpoints are published for
        reader = Fp8DequantReader(reader, plan.scales, plan.block_size, dtype)
        record["dtype"] = str(dtype).removeprefix("torch.")
    return reader, without_quantization(config), record


def _load_config(path: Path) -> dict[str, object] | None:
    """The parsed ``config.json``, or None when absent or not a JSON object (weights still usable)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return raw if isinstance(raw, dict) else None


def _weight_files(path: Path) -> tuple[Format, list[Path], ShardIndex | None]:
    if path.is_file():
        return _single_file(path)
    found = _discover(path, (".safetensors",), "model.safetensors")
    if found is not None:
        return "safetensors", *found
    found = _discover(path, PICKLE_SUFFIXES, "pytorch_model.bin")
    if found is not None:
        return "pickle", *found
    raise NoWeightFiles(f"no safetensors or torch pickle weights in {path.name}")


def _single_file(path: Path) -> tuple[Format, list[Path], ShardIndex | None]:
    name = path.name
    if name.endswith(".index.json"):
        index = load_index(path)
        inner = name.removesuffix(".index.json")
        if inner.endswith(".safetensors"):
            return "safetensors", index.shards, index
        return "pickle", index.shards, index
    if path.suffix == ".safetensors":
        return "safetensors", [path], None
    if path.suffix in PICKLE_SUFFIXES:
        return "pickle", [path], None
    raise NoWeightFiles(f"{name} is not a safetensors or torch pickle weights file")


def _discover(
    root: Path, suffixes: tuple[str, ...], preferred: str
) -> tuple[list[Path], ShardIndex | None] | None:
    preferred_index = root / f"{preferred}.index.json"
    if preferred_index.is_file():
        index = load_index(preferred_index)
        return index.shards, index
    if (root / preferred).is_file():
        return [root / preferred], None
    indexes = sorted(p for s in suffixes for p in root.glob(f"*{s}.index.json") if p.is_file())
    if len(indexes) > 1:
        names = ", ".join(p.name for p in indexes)
        raise CheckpointError(f"several shard indexes in {root.name}, cannot choose: {names}")
    if indexes:
        index = load_index(indexes[0])
        return index.shards, index
    files = sorted(
        p
        for p in root.iterdir()
        if p.suffix in suffixes and p.is_file() and p.name not in NOT_WEIGHTS
    )
    return (files, None) if files else None
