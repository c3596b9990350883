"""What llama.cpp's graph for a family takes for granted and a config.json can contradict.

llama.cpp's converter writes these families without complaint, but llama.cpp then builds the
model with a constant where transformers reads the config: Falcon's FFN is 4 x hidden, Gemma 2's
and Gemma 3's attention scale is 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B layer
counts), Qwen2-MoE never renormalises its top-k expert weights and Qwen3-MoE always does,
Command-R ties its output to the embedding and has q/k norms exactly when it has 64 layers or
more, GPT-NeoX and Falcon rotate with a base of 10000 (the converter writes none). A checkpoint
that says otherwise makes a GGUF llama.cpp refuses to load ("tensor 'blk.0.ffn_down.weight' has
wrong shape") or runs with other logits than transformers'; the check caught both after the
export, and the job failed after its download and offload. :func:`check_assumptions` refuses
them from the config alone, at submission for a local source and before any work in the job.

Each rule names the llama.cpp source it reads (``src/models/<arch>.cpp`` of the pinned
llama.cpp, ``service.shims.llama_cpp.LLAMA_CPP_PYTHON_VERSION``), and returns what in the config
contradicts it, or nothing; ``tests/unit/exporters/gguf/test_assumptions.py`` holds each rule
against the configs of the published models it must accept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.errors import UnsupportedExport

Rule = Callable[[dict[str, Any]], list[str]]


def _int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _rope_theta(config: dict[str, Any]) -> float:
    """The rotary base under any of its names (transformers 5's ``rope_parameters``, 4's
    ``rope_theta``, GPT-NeoX's ``rotary_emb_base``); transformers' default 10000 otherwise."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("rope_theta"), (int, float)):
        return float(params["rope_theta"])
    for key in ("rope_theta", "rotary_emb_base"):
        if isinstance(config.get(key), (int, float)):
            return float(config[key])
    return 10000.0


def _falcon(config: dict[str, Any]) -> list[str]:
    """``src/models/falcon.cpp``: FFN width from the converter's ``4 * hidden_size``, attention
    and FFN in parallel off the layer's input, rotary (no ALiBi), no bias tensors loaded."""
    problems = []
    hidden = _int(config, "hidden_size", "n_embed")
    ffn = _int(config, "ffn_hidden_size")
    if hidden is not None and ffn is not None and ffn != 4 * hidden:
        problems.append(
            f"llama.cpp's Falcon has an FFN of 4 x hidden_size ({4 * hidden}); "
            f"ffn_hidden_size is {ffn}"
        )
    if config.get("alibi"):
        problems.append("llama.cpp's Falcon uses rotary positions; the config has alibi")
    if config.get("bias"):
        problems.append("llama.cpp's Falcon loads no bias tensors; the config has bias")
    if not (config.get("parallel_attn", True) or config.get("new_decoder_architecture")):
        problems.append(
            "llama.cpp's Falcon runs attention and FFN in parallel; the config has "
            "parallel_attn false"
        )
    if (theta := _rope_theta(config)) != 10000.0:
        problems.append(
            f"llama.cpp's Falcon rotates with base 10000 (the converter writes no base); "
            f"the config's is {theta:g}"
        )
    return problems


def _command_r(config: dict[str, Any]) -> list[str]:
    """``src/models/command-r.cpp``: the output is the token embedding (no output tensor is
    loaded), q/k norms are loaded exactly when there are 64 layers or more, no bias."""
    problems = []
    if not config.get("tie_word_embeddings", True):
        problems.append(
            "llama.cpp's Command-R uses the token embedding as its output and loads no output "
            "tensor; the config has tie_word_embeddings false"
        )
    layers = _int(config, "num_hidden_layers")
    qk_norm = bool(config.get("use_qk_norm", False))
    if layers is not None and qk_norm != (layers >= 64):
        has = "has" if qk_norm else "has no"
        problems.append(
            f"llama.cpp's Command-R loads q/k norms exactly when it has 64 layers or more; "
            f"this one has {layers} and {has} use_qk_norm"
        )
    if config.get("attention_bias"):
        problems.append(
            "llama.cpp's Command-R loads no bias tensors; the config has attention_bias"
        )
    return problems


def _gemma_scale(big_layers: int, source: str) -> Rule:
    """``src/models/<source>.cpp``: queries scaled by 1/sqrt(head_dim), or 1/sqrt(hidden/heads)
    for the layer count of the 27B model; transformers scales by query_pre_attn_scalar."""

    def rule(config: dict[str, Any]) -> list[str]:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        assert isinstance(text, dict)
        scalar = text.get("query_pre_attn_scalar", 256)
        layers, hidden = _int(text, "num_hidden_layers"), _int(text, "hidden_size")
        heads = _int(text, "num_attention_heads")
        head_dim = _int(text, "head_dim") or (hidden // heads if hidden and heads else None)
        if layers is None or head_dim is None or not isinstance(scalar, (int, float)):
            return []
        if layers == big_layers and hidden and heads:
            expected, what = (
                hidden // heads,
                f"hidden_size / num_attention_heads ({big_layers} layers)",
            )
        else:
            expected, what = head_dim, "head_dim"
        if scalar == expected:
            return []
        return [
            (
                f"llama.cpp ({source}.cpp) scales attention by 1/sqrt({what}) = "
                f"1/sqrt({expected}); the config's query_pre_attn_scalar is {scalar:g}"
            )
        ]

    return rule


def _expert_norm(normalised: bool, source: str) -> Rule:
    """``src/models/<source>.cpp``: the top-k expert weights are renormalised, or not, whatever
    ``norm_topk_prob`` says (the converter writes no key for it)."""

    def rule(config: dict[str, Any]) -> list[str]:
        if bool(config.get("norm_topk_prob", False)) == normalised:
            return []
        does = "always renormalises" if normalised else "never renormalises"
        return [
            (
                f"llama.cpp ({source}.cpp) {does} the top-k expert weights; the config has "
                f"norm_topk_prob {str(not normalised).lower()}"
            )
        ]

    return rule


def _gpt_neox(config: dict[str, Any]) -> list[str]:
    """``src/models/gptneox.cpp`` rotates with llama.cpp's default base, 10000: the converter's
    ``GPTNeoXModel`` writes none."""
    if (theta := _rope_theta(config)) == 10000.0:
        return []
    return [
        (
            "llama.cpp's GPT-NeoX rotates with base 10000 (the converter writes no base); the "
            f"config's is {theta:g}"
        )
    ]


ASSUMPTIONS: dict[str, Rule] = {
    "FalconForCausalLM": _falcon,
    "RWForCausalLM": _falcon,
    "CohereForCausalLM": _command_r,
    "Gemma2ForCausalLM": _gemma_scale(46, "gemma2"),
    "Gemma3ForCausalLM": _gemma_scale(62, "gemma3"),
    "Gemma3ForConditionalGeneration": _gemma_scale(62, "gemma3"),
    "Qwen2MoeForCausalLM": _expert_norm(False, "qwen2moe"),
    "Qwen3MoeForCausalLM": _expert_norm(True, "qwen3moe"),
    "GPTNeoXForCausalLM": _gpt_neox,
}
"""Hugging Face architecture -> what in a config contradicts llama.cpp's graph for it."""


def check_assumptions(config: dict[str, Any], architecture: str) -> None:
    """:class:`UnsupportedExport` naming what in ``config`` llama.cpp's graph for
    ``architecture`` does not follow (module doc); nothing for a config it does."""
    rule = ASSUMPTIONS.get(architecture)
    problems = rule(config) if rule else []
    if problems:
        raise UnsupportedExport(
            f"GGUF of {architecture}: llama.cpp would not run this configuration as "
            f"transformers does: {'; '.join(problems)}"
        )
