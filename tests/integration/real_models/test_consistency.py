"""Real checkpoints (the model packages' corpus) pass the config-against-weights check that
refuses lying configs (tests/unit/checkpoint/test_consistency.py)."""

from __future__ import annotations

import json

from service.checkpoint import open_checkpoint
from service.checkpoint.consistency import check_config_matches_weights, safetensors_shapes
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.real_models import real_model


def test_real_checkpoints_agree_with_their_configs(
    tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    for ckpt in (real_model("minilm"), tiny_checkpoint("llama", "safetensors-sharded")):
        shapes = safetensors_shapes(ckpt)
        assert shapes, ckpt
        check_config_matches_weights(json.loads((ckpt / "config.json").read_text()), shapes)
        with open_checkpoint(ckpt):
            pass
