"""What the graph exporters (NNEF, ONNX) share: the model they are given, judged from
config.json alone, and what they need of the job.

Both export a causal LM with its KV cache and anything else as an encoder, and both are tested
on the same encoders; each format keeps its own list of causal-LM families, which differ.
"""

from __future__ import annotations

from typing import Any

from service.errors import UnsupportedExport
from service.exporters.base import Exporter, ExportSpec, Needs

ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
"""Encoders whose traced export runs like PyTorch in tract and in onnxruntime, in the tests (tiny
ones of each, and real all-MiniLM)."""


def is_causal_lm(config: dict[str, Any]) -> bool:
    """Whether config.json names a causal LM (``*ForCausalLM``, ``*LMHeadModel``)."""
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)


def refuse_multimodal(config: dict[str, Any], format_name: str) -> None:
    """A vision-language model (a ``vision_config`` beside the text model) is refused with
    :class:`UnsupportedExport` naming what the format takes and what takes a VLM: the graph
    exporters trace one text module with token ids in, and a VLM's forward needs the image
    tower, the projector and pixel inputs that neither tracing nor the parity checks cover."""
    if isinstance(config.get("vision_config"), dict):
        architectures = config.get("architectures") or [config.get("model_type")]
        raise UnsupportedExport(
            f"{format_name} export takes text models (causal LMs with their KV cache, and the "
            f"encoders {', '.join(sorted(ENCODER_TYPES))}), not the vision-language model "
            f"{architectures[0]}; a VLM exports as safetensors (every sub-model and the "
            "processor files) or as GGUF (the text model and its mmproj projector)"
        )


class GraphExporter(Exporter, abstract=True):
    """An exporter that traces the job's meta-built module into a graph and checks the graph
    itself, in a child process (tract, onnxruntime); each format declares the rest."""

    def needs(self, spec: ExportSpec) -> Needs:
        """The meta module to trace and the offload store to stream weights from; the export
        verifies itself in a child process, so no reference from the pipeline."""
        return Needs(module=True)
