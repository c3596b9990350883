"""Which model a graph exporter (NNEF, ONNX) is given, judged from config.json alone.

Both export a causal LM with its KV cache and anything else as an encoder, and both are tested
on the same encoders; each format keeps its own list of causal-LM families, which differ.
"""

from __future__ import annotations

from typing import Any

ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
"""Encoders whose traced export runs like PyTorch in tract and in onnxruntime, in the tests (tiny
ones of each, and real all-MiniLM)."""


def is_causal_lm(config: dict[str, Any]) -> bool:
    """Whether config.json names a causal LM (``*ForCausalLM``, ``*LMHeadModel``)."""
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
