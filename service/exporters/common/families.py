"""What the graph exporters (NNEF, ONNX) share: the model they are given, judged from
config.json alone, and what they need of the job.

Both export a causal LM with its KV cache and anything else as an encoder, and both are tested
on the same encoders; each format keeps its own list of causal-LM families, which differ.
"""

from __future__ import annotations

from typing import Any

from service.exporters.base import Exporter, ExportSpec, Needs

ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
"""Encoders whose traced export runs like PyTorch in tract and in onnxruntime, in the tests (tiny
ones of each, and real all-MiniLM)."""


def is_causal_lm(config: dict[str, Any]) -> bool:
    """Whether config.json names a causal LM (``*ForCausalLM``, ``*LMHeadModel``)."""
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)


class GraphExporter(Exporter):
    """An exporter that traces the job's meta-built module into a graph and checks the graph
    itself, in a child process (tract, onnxruntime)."""

    def needs(self, spec: ExportSpec) -> Needs:
        """The meta module to trace and the offload store to stream weights from; the export
        verifies itself in a child process, so no reference from the pipeline."""
        return Needs(module=True)
