"""Sharded-checkpoint indexes (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``).

The index is ``{"metadata": {"total_size": int, ...}, "weight_map": {tensor name: shard file}}``.
Shard names come from an untrusted file, so each must be a plain relative path that stays under
the checkpoint directory; the check is lexical (no absolute paths, no ``..``) because hub caches
legitimately make shards symlinks into a blob store elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from service.errors import CorruptCheckpoint, MissingShard, PathOutsideRoot


@dataclass(frozen=True)
class ShardIndex:
    path: Path
    weight_map: dict[str, Path]
    """Tensor name -> shard path (under the index's directory)."""
    shards: list[Path]
    """Distinct shard files, sorted by name (the order their tensors are read in)."""
    total_size: int | None


def shard_path(root: Path, name: str) -> Path:
    """``root / name`` for a shard name taken from an index; refuses names leaving ``root``."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or "\\" in name or any(p in ("..", "") for p in pure.parts):
        raise PathOutsideRoot(f"index names a shard outside the checkpoint directory: {name!r}")
    return root.joinpath(*pure.parts)


def load_index(path: Path) -> ShardIndex:
    """Parse and check a shard index; a shard it names that is missing raises :class:`MissingShard`."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{path.name} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise CorruptCheckpoint(f"{path.name}: JSON nested too deeply") from exc
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpoint(f"{path.name} has no weight_map")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptCheckpoint(f"{path.name}: weight_map must map tensor names to file names")
    root = path.parent
    resolved = {name: shard_path(root, shard) for name, shard in weight_map.items()}
    shards = sorted(set(resolved.values()), key=lambda p: p.name)
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise MissingShard(f"{path.name} names shard(s) that are not present: {', '.join(missing)}")
    metadata = raw.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    total_size = total if isinstance(total, int) and not isinstance(total, bool) else None
    return ShardIndex(path=path, weight_map=resolved, shards=shards, total_size=total_size)


def check_index_matches(index: ShardIndex, stored: dict[str, Path]) -> None:
    """Every indexed tensor must be in the shard the index names (``stored``: name -> file)."""
    for name, shard in index.weight_map.items():
        actual = stored.get(name)
        if actual is None:
            raise CorruptCheckpoint(f"{index.path.name} lists {name!r} but no shard contains it")
        if actual != shard:
            raise CorruptCheckpoint(
                f"{index.path.name} puts {name!r} in {shard.name} but it is in {actual.name}"
            )
