"""service.shims.transformers_capture: what a transformers model needs before the ONNX capture.

If one of these fails after a transformers upgrade, the assumption its name states no longer
holds: the family it names would then fail the ONNX capture (or its reference run) in the job.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from service.shims.transformers_capture import (
    _falcon_split_heads,
    plain_linears,
    prepare_for_capture,
)


def _tiny(model_type: str, **config: object) -> torch.nn.Module:
    sizes: dict[str, object] = {
        "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **config))


def test_gemma2_refuses_sdpa_with_a_value_error_and_is_captured_with_eager() -> None:
    model = _tiny("gemma2", head_dim=8, num_key_value_heads=2)
    with pytest.raises(ValueError):
        model.set_attn_implementation("sdpa")
    prepare_for_capture(model)
    assert model.config._attn_implementation == "eager"


def test_a_moe_runs_grouped_mm_and_takes_batched_mm_a_dense_model_runs_eager() -> None:
    model = _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2)
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    prepare_for_capture(model)
    assert model.get_experts_implementation() == {"": "batched_mm"}
    dense = _tiny("llama", num_key_value_heads=2)
    prepare_for_capture(dense)
    assert dense.get_experts_implementation() == {"": "eager"}


@pytest.mark.parametrize(
    "config",
    [
        {"new_decoder_architecture": True, "num_kv_heads": 2},
        {"new_decoder_architecture": False, "multi_query": True},
        {"new_decoder_architecture": False, "multi_query": False},
    ],
    ids=["new-architecture", "multi-query", "multi-head"],
)
def test_falcons_split_heads_with_slices_is_transformers_own(config: dict[str, object]) -> None:
    model = _tiny("falcon", **config)
    attention = model.transformer.h[0].self_attention
    assert type(attention).__name__ == "FalconAttention"
    fused = torch.randn(2, 3, attention.query_key_value.out_features)
    for ours, theirs in zip(
        _falcon_split_heads(attention, fused), attention._split_heads(fused), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_falcons_linear_is_a_stateless_linear_subclass_with_linears_numbers() -> None:
    model = _tiny("falcon", new_decoder_architecture=True, num_kv_heads=2, bias=True)
    layer = model.transformer.h[0].self_attention.query_key_value
    assert type(layer).__name__ == "FalconLinear" and isinstance(layer, torch.nn.Linear)
    x = torch.randn(2, 3, layer.in_features)
    expected = layer(x)
    plain_linears(model)
    assert type(layer) is torch.nn.Linear
    torch.testing.assert_close(layer(x), expected)
