"""Streaming safetensors export in the Hugging Face layout, optionally cast to another float dtype.

Output (what ``save_pretrained`` writes, so ``from_pretrained`` loads it unchanged):

* one shard: ``model.safetensors``;
* several: ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
  ``{"metadata": {"total_size", "total_parameters"}, "weight_map": {name: shard}}``;
* the checkpoint's aux files (config, tokenizer...); ``config.json`` gets the new ``dtype``.

The whole layout (shard plan, every header) is computed from tensor metadata before a byte of
data is read; data then flows tensor by tensor in chunks of at most ``CHUNK_BYTES`` (read, cast,
hash, write), so memory stays at a few chunks whatever the model size. Shards are split as
``huggingface_hub.split_torch_state_dict_into_shards`` does, except that the header is counted
too, so every shard file is ``<= max_shard_size`` unless a single tensor is larger.

Only floating tensors are cast; integer and bool tensors keep their dtype. Tied weights are
stored once under the name transformers expects (see :mod:`service.checkpoint.ties`).

This module is what the API process needs (the spec, the submission check); the writer, which
needs torch, is :mod:`service.exporters.safetensors_writer`, imported by ``export``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from service.errors import InvalidRequest
from service.exporters.base import ExportInputs, ExportResult, ExportSpec, register
from service.jobs.context import JobContext
from service.units import parse_size

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
OutDtype = Literal["float32", "float16", "bfloat16"]


class SafetensorsSpec(ExportSpec):
    format: Literal["safetensors"] = "safetensors"
    dtype: OutDtype | None = None
    """Cast floating tensors to this dtype; None keeps each tensor's own dtype."""
    max_shard_size: str | int = "5GB"
    """Largest shard file: bytes, or "5GB" (10^9), "500MB", "1GiB" (2^30)."""


class SafetensorsExporter:
    format: ClassVar[str] = "safetensors"
    spec_type: ClassVar[type[ExportSpec]] = SafetensorsSpec
    needs_model: ClassVar[bool] = False

    def check(self, spec: ExportSpec, config: dict[str, Any] | None) -> None:
        """Reject an unparseable ``max_shard_size`` at submission time."""
        parse_size(_safetensors_spec(spec).max_shard_size)

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        from service.exporters.safetensors_writer import export_safetensors

        return export_safetensors(_safetensors_spec(spec), inputs, out_dir, ctx)


def _safetensors_spec(spec: ExportSpec) -> SafetensorsSpec:
    if not isinstance(spec, SafetensorsSpec):
        raise InvalidRequest(f"not a safetensors export spec: {spec.format}")
    return spec


exporter = register(SafetensorsExporter())
