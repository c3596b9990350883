"""``genai_config.json``: what makes an export directory an onnxruntime-genai package.

``onnxruntime_genai.Model(dir)`` reads the graph's file name, its input and output names, the
KV cache's geometry and the search defaults from this file; the tokenizer (``tokenizer.json``,
``tokenizer_config.json``) and the chat template (``chat_template.jinja`` or the tokenizer
config's ``chat_template``) are the checkpoint's own, copied beside it. The fields are those
onnxruntime-genai's model builder writes (``onnxruntime_genai/models/builders/base.py``,
``make_genai_config``, 0.18.0), filled from ``config.json`` and ``generation_config.json``.

The graph is the one optimum loads: ``past_key_values.%d.key|value`` in, ``present.%d.key|value``
out, each ``[batch, kv_heads, sequence, head_dim]``, the present being the past with the new
positions appended. That is onnxruntime-genai's default KV cache when
``past_present_share_buffer`` is false (the builder sets it true only for its
``GroupQueryAttention`` graphs, whose present is written into the past's buffer in place), so
the same graph runs in both consumers and the layout is this file alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.fsutil import atomic_write_json

GENAI_CONFIG = "genai_config.json"

GENAI_DECODER_TYPES = frozenset({
    "chatglm", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gemma4_text", "gptoss", "granite",
    "hunyuandensev1", "internlm2", "llama", "mistral", "nemotron", "olmo", "phi", "phimoe", "phi3",
    "phi3small", "qwen2", "qwen3", "smollm3",
})  # fmt: skip
"""``model.type`` values onnxruntime-genai 0.18 runs as a decoder-only LLM (its
``ModelType::IsLLM``; ``gpt2`` left out: it has a model class of its own), as transformers
spells them. Each selects the same ``DecoderOnly_Model``, which takes the graph's input and
output names and the KV cache's geometry from this file, so the label does not change how the
graph runs. A family og does not list is written as ``"decoder"``, og's generic decoder-only
type (in the same list): its own ``model_type`` would be refused when ``og.Model`` loads
(``Unsupported model_type in config.json``). Either way the package is run in og's generator by
the export's check (``verify.check_genai``)."""


def genai_model_type(model_type: str) -> str:
    """The ``model.type`` onnxruntime-genai is given for a transformers ``model_type``."""
    return model_type if model_type in GENAI_DECODER_TYPES else "decoder"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _tokenizer_eos(out_dir: Path) -> int | None:
    """The tokenizer's ``eos_token`` id (a chat model's end of turn, which config.json often
    omits: the builder adds it to the stop ids for the same reason)."""
    token = _read_json(out_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    for added in _read_json(out_dir / "tokenizer.json").get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token:
            return int(added["id"])
    return None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def genai_config(
    config: dict[str, Any], inputs: dict[str, Any], out_dir: Path, filename: str
) -> dict[str, Any]:
    """The builder's ``genai_config.json`` for the decoder graph ``filename`` whose inputs are
    ``inputs`` (names to shapes), with the checkpoint's files already in ``out_dir``."""
    generation = _read_json(out_dir / "generation_config.json")

    def pick(key: str) -> Any:
        return generation.get(key) if generation.get(key) is not None else config.get(key)

    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    eos = _ids(pick("eos_token_id"))
    turn_end = _tokenizer_eos(out_dir)
    if turn_end is not None and turn_end not in eos:
        eos.append(turn_end)
    pad = pick("pad_token_id")
    context = int(config.get("max_position_embeddings") or 4096)
    names = {key: key for key in ("input_ids", "attention_mask", "position_ids") if key in inputs}
    return {
        "model": {
            "bos_token_id": int(pick("bos_token_id") if pick("bos_token_id") is not None else 1),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": int(config.get("head_dim") or hidden // heads),
                "hidden_size": hidden,
                "inputs": {
                    **names,
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": heads,
                "num_hidden_layers": int(config["num_hidden_layers"]),
                "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": int(pad) if pad is not None else (eos[0] if eos else 0),
            "type": genai_model_type(str(config.get("model_type") or "")),
            "vocab_size": int(config["vocab_size"]),
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": bool(generation.get("do_sample", False)),
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": float(generation.get("repetition_penalty") or 1.0),
            "temperature": float(generation.get("temperature") or 1.0),
            "top_k": int(generation.get("top_k") or 50),
            "top_p": float(generation.get("top_p") or 1.0),
        },
    }


def write_genai_config(
    config: dict[str, Any] | None, inputs: dict[str, Any], out_dir: Path, filename: str
) -> str:
    """Write ``genai_config.json`` into ``out_dir`` (crash-safe); returns its file name."""
    assert config is not None
    atomic_write_json(out_dir / GENAI_CONFIG, genai_config(config, inputs, out_dir, filename))
    return GENAI_CONFIG
