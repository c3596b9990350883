"""Readers return exactly what transformers saved, tensor by tensor, for every layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

from service.checkpoint import open_checkpoint
from service.checkpoint.base import ReadsInto
from service.checkpoint.safetensors import SafetensorsReader, parse_header
from service.checkpoint.torch_pickle import PickleReader
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.models import KINDS, Arch, CheckpointKind, build_tiny_model, copy_tree


def _expected(arch: Arch, tied: bool = False) -> dict[str, torch.Tensor]:
    return build_tiny_model(arch, tie_word_embeddings=tied).state_dict()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_every_layout_reads_back_the_saved_weights(
    tiny_checkpoint: TinyCheckpointFactory, arch: Arch, kind: CheckpointKind
) -> None:
    expected = _expected(arch)
    with open_checkpoint(tiny_checkpoint(arch, kind)) as ckpt:
        assert ckpt.format == ("safetensors" if kind.startswith("safetensors") else "pickle")
        assert (len(ckpt.weight_files) > 1) == kind.endswith("sharded")
        infos = ckpt.reader.tensor_infos()
        assert {i.name for i in infos} == set(expected)
        for info in infos:
            got = ckpt.reader.read(info.name)
            assert got.dtype == expected[info.name].dtype == info.dtype
            assert tuple(got.shape) == info.shape
            assert torch.equal(got, expected[info.name]), info.name


def test_safetensors_storage_order_follows_file_offsets(llama_safetensors_dir: Path) -> None:
    reader = SafetensorsReader([llama_safetensors_dir / "model.safetensors"])
    regions = [reader.region(i.name) for i in reader.tensor_infos()]
    offsets = [r.offset for r in regions]
    assert offsets == sorted(offsets)
    assert all(r.path.name == "model.safetensors" for r in regions)
    reader.close()


def test_region_points_at_the_tensor_bytes_in_place(llama_safetensors_dir: Path) -> None:
    path = llama_safetensors_dir / "model.safetensors"
    with SafetensorsReader([path]) as reader:
        name = "model.layers.0.self_attn.q_proj.weight"
        region = reader.region(name)
        with path.open("rb") as f:
            f.seek(region.offset)
            raw = f.read(region.length)
        assert raw == reader.read(name).numpy().tobytes()


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
@pytest.mark.parametrize("max_bytes", [1, 100, 4096, 1 << 30])
def test_chunks_concatenate_to_the_tensor_and_respect_the_bound(
    tiny_checkpoint: TinyCheckpointFactory, kind: CheckpointKind, max_bytes: int
) -> None:
    with open_checkpoint(tiny_checkpoint("llama", kind)) as ckpt:
        name = "model.embed_tokens.weight"
        chunks = list(ckpt.reader.iter_chunks(name, max_bytes))
        itemsize = torch.float32.itemsize
        assert all(c.numel() * itemsize <= max(max_bytes, itemsize) for c in chunks)
        assert torch.equal(torch.cat(chunks), ckpt.reader.read(name).reshape(-1))


def test_read_returns_a_fresh_tensor_the_caller_owns(llama_bin_dir: Path) -> None:
    with open_checkpoint(llama_bin_dir) as ckpt:
        name = "model.norm.weight"
        first = ckpt.reader.read(name)
        first.zero_()
        assert not torch.equal(ckpt.reader.read(name), first)


def test_pickle_tied_weights_are_reported_as_aliases(
    tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    expected = _expected("llama", tied=True)
    for kind in ("bin", "bin-sharded"):
        with open_checkpoint(tiny_checkpoint("llama", kind, tied=True)) as ckpt:
            aliases = ckpt.reader.aliases()
            assert len(aliases) == 1
            ((alias, canonical),) = aliases.items()
            assert {alias, canonical} == {"lm_head.weight", "model.embed_tokens.weight"}
            names = {i.name for i in ckpt.reader.tensor_infos()}
            assert canonical in names and alias not in names
            assert torch.equal(ckpt.reader.read(alias), expected["lm_head.weight"])


def test_a_tied_safetensors_weight_is_readable_under_both_names_whichever_is_stored(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """save_pretrained stores the input name, safetensors' save_model the output name; both
    open with the tie resolved once, so no exporter has to guess."""
    model = build_tiny_model("llama", tie_word_embeddings=True)
    embed = model.state_dict()["model.embed_tokens.weight"]
    as_output = copy_tree(tiny_checkpoint("llama", "safetensors", tied=True), tmp_path / "out")
    save_model(model, str(as_output / "model.safetensors"))  # keeps lm_head.weight only
    for ckpt_dir, stored, alias in (
        (tiny_checkpoint("llama", "safetensors", tied=True), "model.embed_tokens.weight",
         "lm_head.weight"),
        (as_output, "lm_head.weight", "model.embed_tokens.weight"),
    ):
        with open_checkpoint(ckpt_dir) as ckpt:
            assert {i.name for i in ckpt.reader.tensor_infos()} >= {stored}
            assert alias not in {i.name for i in ckpt.reader.tensor_infos()}
            assert ckpt.reader.aliases() == {alias: stored}
            assert torch.equal(ckpt.reader.read(alias), embed)


def test_an_untied_checkpoint_missing_its_output_weight_is_not_tied_to_the_embedding(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt_dir = copy_tree(tiny_checkpoint("llama", "safetensors"), tmp_path / "untied")
    state = load_file(ckpt_dir / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, ckpt_dir / "model.safetensors", metadata={"format": "pt"})
    with open_checkpoint(ckpt_dir) as ckpt:
        assert ckpt.reader.aliases() == {}
        with pytest.raises(KeyError):
            ckpt.reader.read("lm_head.weight")


def test_every_safetensors_dtype_round_trips(tmp_path: Path) -> None:
    tensors = {
        "f64": torch.randn(3, dtype=torch.float64),
        "f16": torch.randn(2, 3).half(),
        "bf16": torch.randn(5).bfloat16(),
        "i64": torch.arange(7, dtype=torch.int64),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([200, 1], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, path)
    with SafetensorsReader([path]) as reader:
        for name, t in tensors.items():
            got = reader.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            raw = got.reshape(-1).view(torch.uint8)
            assert torch.equal(raw, t.reshape(-1).view(torch.uint8)), name


def test_header_metadata_is_exposed(llama_safetensors_dir: Path) -> None:
    header = parse_header(llama_safetensors_dir / "model.safetensors")
    assert header.metadata.get("format") == "pt"


def test_open_a_single_weights_file_collects_its_neighbours(llama_bin_dir: Path) -> None:
    with open_checkpoint(llama_bin_dir / "pytorch_model.bin") as ckpt:
        assert isinstance(ckpt.reader, PickleReader)
        assert ckpt.config is not None and ckpt.config["model_type"] == "llama"


def test_aux_files_and_config_are_collected(llama_sharded_safetensors_dir: Path) -> None:
    with open_checkpoint(llama_sharded_safetensors_dir) as ckpt:
        names = {p.name for p in ckpt.aux_files}
        assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
        assert ckpt.config is not None and ckpt.config["num_hidden_layers"] == 2


def test_safetensors_preferred_over_pickles(tmp_path: Path, llama_bin_dir: Path) -> None:
    both = _copy(llama_bin_dir, tmp_path / "both")
    save_file({"only": torch.ones(2)}, both / "model.safetensors")
    with open_checkpoint(both) as ckpt:
        assert ckpt.format == "safetensors"
        assert [i.name for i in ckpt.reader.tensor_infos()] == ["only"]


def test_invalid_config_json_gives_no_config(tmp_path: Path, llama_safetensors_dir: Path) -> None:
    ckpt_dir = _copy(llama_safetensors_dir, tmp_path / "c")
    (ckpt_dir / "config.json").write_text("{not json")
    with open_checkpoint(ckpt_dir) as ckpt:
        assert ckpt.config is None
    (ckpt_dir / "config.json").write_text(json.dumps([1, 2]))
    with open_checkpoint(ckpt_dir) as ckpt:
        assert ckpt.config is None


def _copy(src: Path, dst: Path) -> Path:
    return copy_tree(src, dst)


@pytest.mark.parametrize("kind", ["safetensors-sharded", "bin"])
def test_read_into_fills_a_caller_buffer_with_any_element_range(
    tiny_checkpoint: TinyCheckpointFactory, kind: CheckpointKind
) -> None:
    with open_checkpoint(tiny_checkpoint("llama", kind)) as ckpt:
        reader = ckpt.reader
        assert isinstance(reader, ReadsInto)
        name = "model.layers.1.mlp.down_proj.weight"
        whole = reader.read(name).reshape(-1)
        out = torch.full((100,), -1.0)
        for start in (0, 37, whole.numel() - 100):
            reader.read_into(name, start, out)
            assert torch.equal(out, whole[start : start + 100])
        with pytest.raises(IndexError):
            reader.read_into(name, whole.numel() - 50, out)
        with pytest.raises(ValueError):
            reader.read_into(name, 0, out.half())


def test_aux_files_follow_the_one_pattern_list_the_hub_downloads(
    tmp_path: Path, llama_sharded_safetensors_dir: Path
) -> None:
    from service.checkpoint import AUX_PATTERNS
    from service.shims.huggingface_hub import filter_repo_objects

    root = _copy(llama_sharded_safetensors_dir, tmp_path / "ckpt")
    for name in ("cl100k_base.tiktoken", "preprocessor_config.json", "notes.txt", "README.md"):
        (root / name).write_text("{}")
    with open_checkpoint(root) as ckpt:
        names = [p.name for p in ckpt.aux_files]
    assert names == sorted(names)
    assert {"cl100k_base.tiktoken", "preprocessor_config.json", "config.json"} <= set(names)
    assert not {"notes.txt", "README.md"} & set(names)
    # The hub fetches exactly what the checkpoint then carries over: nothing downloaded is lost.
    listed = sorted(p.name for p in root.iterdir())
    assert sorted(filter_repo_objects(listed, allow_patterns=list(AUX_PATTERNS))) == names
