"""Every kind of broken checkpoint fails at open with its own typed error, never with garbage."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from service.checkpoint import open_checkpoint
from service.checkpoint.index import shard_path
from service.errors import (
    CheckpointError,
    CorruptCheckpoint,
    MissingShard,
    NoWeightFiles,
    PathOutsideRoot,
    SourceNotFound,
    UnsafePickle,
)
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.models import (
    copy_tree,
    make_lying_offsets,
    make_overlapping_offsets,
    read_safetensors_header,
    rewrite_safetensors_header,
    truncate_file,
    write_index_with_missing_shard,
    write_pickle_with_object,
    write_raw_pickle_with_object,
)


@pytest.fixture
def st_copy(tmp_path: Path, llama_safetensors_dir: Path) -> Path:
    return copy_tree(llama_safetensors_dir, tmp_path / "ckpt")


def test_truncated_safetensors_is_corrupt(st_copy: Path) -> None:
    truncate_file(st_copy / "model.safetensors", 16)
    with pytest.raises(CorruptCheckpoint, match="truncated|covers|ends at"):
        open_checkpoint(st_copy)


def test_safetensors_cut_inside_the_header_is_corrupt(st_copy: Path) -> None:
    path = st_copy / "model.safetensors"
    truncate_file(path, path.stat().st_size - 100)
    with pytest.raises(CorruptCheckpoint, match="header length"):
        open_checkpoint(st_copy)


def test_header_length_larger_than_file_is_corrupt(st_copy: Path) -> None:
    path = st_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match="past the end"):
        open_checkpoint(st_copy)


def test_header_offsets_past_the_data_are_corrupt(st_copy: Path) -> None:
    make_lying_offsets(st_copy / "model.safetensors")
    with pytest.raises(CorruptCheckpoint):
        open_checkpoint(st_copy)


def test_overlapping_regions_are_corrupt(st_copy: Path) -> None:
    make_overlapping_offsets(st_copy / "model.safetensors")
    with pytest.raises(CorruptCheckpoint, match="overlap"):
        open_checkpoint(st_copy)


def test_size_not_matching_shape_is_corrupt(st_copy: Path) -> None:
    path = st_copy / "model.safetensors"
    header, _ = read_safetensors_header(path)
    entry = dict(header["model.norm.weight"])  # type: ignore[call-overload]
    entry["shape"] = [entry["shape"][0] + 1]
    header["model.norm.weight"] = entry
    rewrite_safetensors_header(path, header)
    with pytest.raises(CorruptCheckpoint, match="needs"):
        open_checkpoint(st_copy)


def test_unknown_dtype_is_corrupt(st_copy: Path) -> None:
    path = st_copy / "model.safetensors"
    header, _ = read_safetensors_header(path)
    entry = dict(header["model.norm.weight"])  # type: ignore[call-overload]
    entry["dtype"] = "F33"
    header["model.norm.weight"] = entry
    rewrite_safetensors_header(path, header)
    with pytest.raises(CorruptCheckpoint, match="unknown dtype"):
        open_checkpoint(st_copy)


def test_header_that_is_not_json_is_corrupt(st_copy: Path) -> None:
    path = st_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff{{{"
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match="JSON"):
        open_checkpoint(st_copy)


def test_duplicate_keys_in_header_are_corrupt(tmp_path: Path) -> None:
    raw = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
    raw += b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"xy")
    with pytest.raises(CorruptCheckpoint, match="duplicate"):
        open_checkpoint(tmp_path)


def test_trailing_garbage_after_the_data_is_corrupt(st_copy: Path) -> None:
    with (st_copy / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptCheckpoint):
        open_checkpoint(st_copy)


def test_pickle_with_an_arbitrary_object_is_unsafe(tmp_path: Path) -> None:
    write_pickle_with_object(tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafePickle):
        open_checkpoint(tmp_path)


def test_legacy_non_zip_pickle_is_refused_without_unpickling(tmp_path: Path) -> None:
    write_raw_pickle_with_object(tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="legacy"):
        open_checkpoint(tmp_path / "model.pt")


def test_truncated_pickle_is_corrupt(tmp_path: Path, llama_bin_dir: Path) -> None:
    ckpt = copy_tree(llama_bin_dir, tmp_path / "c")
    path = ckpt / "pytorch_model.bin"
    truncate_file(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError):
        open_checkpoint(ckpt)


def test_pickle_that_is_not_a_state_dict_is_corrupt(tmp_path: Path) -> None:
    torch.save([torch.ones(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(CorruptCheckpoint, match="state dict"):
        open_checkpoint(tmp_path)


def test_wrapped_training_checkpoint_is_unwrapped(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "pytorch_model.bin")
    with open_checkpoint(tmp_path) as ckpt:
        assert [i.name for i in ckpt.reader.tensor_infos()] == ["w"]


@pytest.mark.parametrize("kind", ["safetensors-sharded", "bin-sharded"])
def test_index_naming_a_missing_shard(
    tmp_path: Path, tiny_checkpoint: TinyCheckpointFactory, kind: str
) -> None:
    ckpt = copy_tree(tiny_checkpoint("llama", kind), tmp_path / "c")
    missing = write_index_with_missing_shard(ckpt)
    with pytest.raises(MissingShard, match=missing):
        open_checkpoint(ckpt)


def test_deleted_shard_is_missing(tmp_path: Path, llama_sharded_safetensors_dir: Path) -> None:
    ckpt = copy_tree(llama_sharded_safetensors_dir, tmp_path / "c")
    (ckpt / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(MissingShard, match="00002"):
        open_checkpoint(ckpt)


def test_index_disagreeing_with_the_shards_is_corrupt(
    tmp_path: Path, llama_sharded_safetensors_dir: Path
) -> None:
    ckpt = copy_tree(llama_sharded_safetensors_dir, tmp_path / "c")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["not.a.stored.tensor"] = "model-00001-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpoint, match="not.a.stored.tensor"):
        open_checkpoint(ckpt)


def test_index_that_is_not_json_is_corrupt(
    tmp_path: Path, llama_sharded_safetensors_dir: Path
) -> None:
    ckpt = copy_tree(llama_sharded_safetensors_dir, tmp_path / "c")
    (ckpt / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CorruptCheckpoint):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "a/../../b", ""])
def test_index_shard_names_cannot_leave_the_checkpoint(tmp_path: Path, name: str) -> None:
    with pytest.raises(PathOutsideRoot):
        shard_path(tmp_path, name)


def test_index_escaping_its_directory_is_refused(
    tmp_path: Path, llama_sharded_safetensors_dir: Path
) -> None:
    ckpt = copy_tree(llama_sharded_safetensors_dir, tmp_path / "c")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../c/model-00001-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(PathOutsideRoot):
        open_checkpoint(ckpt)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "training_args.bin").write_bytes(b"x")
    with pytest.raises(NoWeightFiles):
        open_checkpoint(tmp_path)


def test_file_that_is_not_weights(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NoWeightFiles):
        open_checkpoint(tmp_path / "notes.txt")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFound):
        open_checkpoint(tmp_path / "nope")


DEEP = 200_000
"""Nesting far past the JSON parser's recursion limit (Python's is about 1000 frames)."""


def test_header_that_is_deeply_nested_json_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    raw = b"[" * DEEP + b"]" * DEEP
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptCheckpoint, match="nested too deeply"):
        open_checkpoint(tmp_path)


def test_shard_index_that_is_deeply_nested_json_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(CorruptCheckpoint, match="nested too deeply"):
        open_checkpoint(tmp_path)


def test_config_that_is_deeply_nested_json_is_ignored_like_any_unreadable_config(
    st_copy: Path,
) -> None:
    (st_copy / "config.json").write_text('{"a": ' + "[" * DEEP + "]" * DEEP + "}")
    with open_checkpoint(st_copy) as ckpt:
        assert ckpt.config is None
