"""A config.json that promises what its weights do not hold is refused at open, typed, naming
the key and the tensor, before anything is built on its word (4000 layers on meta take a
minute; a GGUF would carry the config's numbers beside the real tensors)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from service.checkpoint import open_checkpoint
from service.checkpoint.consistency import (
    check_config_matches_weights,
    layer_stacks,
    safetensors_shapes,
)
from service.errors import ConfigMismatch, WeightsMismatch
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.models import copy_tree


def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    out = copy_tree(src, dst)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("kind", ["safetensors", "safetensors-sharded", "bin-sharded"])
def test_a_config_with_4000_layers_on_two_layers_of_weights_is_refused_at_open(
    kind: str, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt = _with_config(tiny_checkpoint("llama", kind), tmp_path / "ckpt", num_hidden_layers=4000)
    started = time.monotonic()
    with pytest.raises(ConfigMismatch, match=r"num_hidden_layers is 4000, but the weights hold 2 "
                       r"layer\(s\) \(model\.layers\.0 to model\.layers\.1\)"):  # fmt: skip
        open_checkpoint(ckpt)
    # Typed and cheap: no model of 4000 layers was built to find out (that took ~50 s).
    assert time.monotonic() - started < 20


def test_a_hidden_size_of_65536_names_the_embedding_that_disagrees(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt = _with_config(tiny_checkpoint("llama"), tmp_path / "ckpt", hidden_size=65536)
    with pytest.raises(ConfigMismatch, match=r"hidden_size is 65536, but "
                       r"model\.embed_tokens\.weight is 64 wide \(shape \[128, 64\]\)"):  # fmt: skip
        open_checkpoint(ckpt)


def test_a_vocab_size_the_embedding_does_not_have_is_refused(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt = _with_config(tiny_checkpoint("bert"), tmp_path / "ckpt", vocab_size=999_999)
    with pytest.raises(ConfigMismatch, match=r"vocab_size is 999999, but .*word_embeddings"):
        open_checkpoint(ckpt)


def test_a_config_mismatch_is_a_weights_mismatch_for_callers_that_catch_that() -> None:
    assert issubclass(ConfigMismatch, WeightsMismatch)
    assert ConfigMismatch.code == "config_mismatch"


def test_a_tied_embedding_stored_only_as_lm_head_is_still_judged() -> None:
    shapes = {"lm_head.weight": [100, 32], "model.layers.0.mlp.up_proj.weight": [64, 32]}
    check_config_matches_weights({"hidden_size": 32, "vocab_size": 100}, shapes)
    with pytest.raises(ConfigMismatch, match="lm_head.weight is 32 wide"):
        check_config_matches_weights({"hidden_size": 65536, "num_hidden_layers": 1}, shapes)


def test_what_the_weights_cannot_show_is_not_judged() -> None:
    # No numbered layers, no recognisable embedding: nothing to compare, nothing refused.
    check_config_matches_weights({"num_hidden_layers": 4000, "hidden_size": 1}, {"w": [3, 3]})
    # Fewer layers in the config than in the weights is a smaller model, not a lie
    # (DeepSeek-V3 ships an extra MTP layer beyond num_hidden_layers).
    check_config_matches_weights(
        {"num_hidden_layers": 1}, {"model.layers.0.w": [2], "model.layers.1.w": [2]}
    )
    # ALBERT's embedding is narrower than its hidden size, and says so.
    check_config_matches_weights(
        {"hidden_size": 768, "embedding_size": 128, "vocab_size": 30000},
        {"albert.embeddings.word_embeddings.weight": [30000, 128]},
    )


def test_layer_stacks_are_counted_per_stack() -> None:
    names = [
        "transformer.h.0.attn.w", "transformer.h.11.attn.w", "encoder.block.5.layer.1.w",
        "decoder.block.2.layer.0.w", "albert.encoder.albert_layer_groups.0.albert_layers.0.w",
    ]  # fmt: skip
    assert layer_stacks(names) == {"transformer.h": 12, "encoder.block": 6, "decoder.block": 3}


def test_headers_are_read_without_the_data(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    sharded = tiny_checkpoint("llama", "safetensors-sharded")
    shapes = safetensors_shapes(sharded)
    assert shapes is not None and shapes["model.embed_tokens.weight"] == [128, 64]
    assert safetensors_shapes(tiny_checkpoint("llama", "bin-sharded")) is None
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\xff" * 16)
    assert safetensors_shapes(garbage) is None  # the job's strict reader names the corruption
