"""What llama.cpp's graph assumes of a family, held against the published configurations it
must take and the ones it must refuse (``service.exporters.gguf.assumptions``)."""

from __future__ import annotations

from typing import Any

import pytest

from service.api.errors import http_status
from service.errors import UnsupportedExport
from service.exporters.gguf.assumptions import ASSUMPTIONS, check_assumptions

PUBLISHED: list[tuple[str, str, dict[str, Any]]] = [
    ("falcon-7b", "FalconForCausalLM",
     {"hidden_size": 4544, "parallel_attn": True, "alibi": False, "bias": False}),
    ("falcon-40b", "FalconForCausalLM",
     {"hidden_size": 8192, "new_decoder_architecture": True, "parallel_attn": True}),
    ("falcon, transformers 5", "FalconForCausalLM",
     {"hidden_size": 64, "ffn_hidden_size": 256, "rope_parameters": {"rope_theta": 10000.0}}),
    ("command-r-v01", "CohereForCausalLM",
     {"num_hidden_layers": 40, "tie_word_embeddings": True, "use_qk_norm": False}),
    ("command-r-plus", "CohereForCausalLM",
     {"num_hidden_layers": 64, "tie_word_embeddings": True, "use_qk_norm": True}),
    ("gemma-2-2b", "Gemma2ForCausalLM",
     {"num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8, "head_dim": 256,
      "query_pre_attn_scalar": 256}),
    ("gemma-2-27b", "Gemma2ForCausalLM",
     {"num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32, "head_dim": 128,
      "query_pre_attn_scalar": 144}),
    ("gemma-3-270m", "Gemma3ForCausalLM",
     {"num_hidden_layers": 18, "hidden_size": 640, "num_attention_heads": 4, "head_dim": 256,
      "query_pre_attn_scalar": 256}),
    ("gemma-3-27b", "Gemma3ForConditionalGeneration",
     {"text_config": {"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
                      "head_dim": 128, "query_pre_attn_scalar": 168}}),
    ("qwen1.5-moe-a2.7b", "Qwen2MoeForCausalLM", {"norm_topk_prob": False}),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", {"norm_topk_prob": True}),
    ("pythia-70m, transformers 4", "GPTNeoXForCausalLM",
     {"rotary_emb_base": 10000, "rotary_pct": 0.25}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "arch", "config"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_configurations_are_taken(name: str, arch: str, config: dict[str, Any]) -> None:
    check_assumptions(config, arch)


CONTRADICTED: list[tuple[str, dict[str, Any], str]] = [
    ("FalconForCausalLM", {"hidden_size": 64, "ffn_hidden_size": 128},
     "an FFN of 4 x hidden_size (256); ffn_hidden_size is 128"),
    ("RWForCausalLM", {"hidden_size": 64, "alibi": True, "parallel_attn": False},
     "the config has alibi; llama.cpp's Falcon runs attention and FFN in parallel"),
    ("FalconForCausalLM", {"hidden_size": 64, "bias": True}, "loads no bias tensors"),
    ("CohereForCausalLM", {"tie_word_embeddings": False}, "tie_word_embeddings false"),
    ("CohereForCausalLM", {"num_hidden_layers": 2, "use_qk_norm": True},
     "this one has 2 and has use_qk_norm"),
    ("Gemma2ForCausalLM",
     {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16},
     "1/sqrt(head_dim) = 1/sqrt(16); the config's query_pre_attn_scalar is 256"),
    ("Gemma3ForCausalLM",
     {"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32, "head_dim": 128,
      "query_pre_attn_scalar": 128},
     "1/sqrt(hidden_size / num_attention_heads (62 layers)) = 1/sqrt(168)"),
    ("Qwen2MoeForCausalLM", {"norm_topk_prob": True}, "never renormalises"),
    ("Qwen3MoeForCausalLM", {}, "always renormalises the top-k expert weights; the config has"),
    ("GPTNeoXForCausalLM", {"rope_parameters": {"rope_theta": 500000.0}}, "config's is 500000"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "config", "why"), CONTRADICTED)
def test_a_configuration_llama_cpp_would_not_follow_is_refused_naming_why(
    arch: str, config: dict[str, Any], why: str
) -> None:
    with pytest.raises(UnsupportedExport) as refused:
        check_assumptions(config, arch)
    assert why in str(refused.value)
    assert arch in str(refused.value)
    assert http_status(refused.value) == 422


def test_an_architecture_without_assumptions_is_taken_whatever_its_config() -> None:
    assert "LlamaForCausalLM" not in ASSUMPTIONS
    check_assumptions({"norm_topk_prob": True, "ffn_hidden_size": 1}, "LlamaForCausalLM")
