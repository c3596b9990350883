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

A mixture of experts is written in the layout asked (``experts``), by default the source's: one
tensor per expert (the Hub's layout, what ``save_pretrained`` writes) or one packed tensor per
projection for all of a layer's experts (what transformers 5's modules hold, what
``save_pretrained(save_original_format=False)`` writes). Which tensors make which stack is
transformers' own conversion (:mod:`service.checkpoint.experts`); a stack is streamed from its
experts' tensors chunk by chunk like any tensor, never held whole.

This module is what the API process needs (the spec, the submission check); the writer, which
needs torch, is :mod:`service.exporters.safetensors.writer`, imported by ``export``; it takes
the spec's fields and never imports this module (no import cycle).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from service.checkpoint.base import Checkpoint
from service.checkpoint.experts import ExpertLayout
from service.errors import InvalidRequest
from service.exporters.base import (
    Exporter,
    ExportInputs,
    ExportResult,
    ExportSpec,
    Needs,
    Producers,
    float_dtype_name,
    register,
)
from service.exporters.safetensors.plan import plan_safetensors
from service.plan import ExportPlan, PlanInputs
from service.stage import JobContext
from service.tensors import dtype_name
from service.units import parse_size

if TYPE_CHECKING:
    from service.config import Settings

OutDtype = Literal["float32", "float16", "bfloat16"]


class SafetensorsSpec(ExportSpec):
    format: Literal["safetensors"] = "safetensors"
    dtype: OutDtype | None = Field(
        default=None,
        description="Cast floating tensors to this dtype (also spelled f32, f16, bf16; any "
        "case); integer and bool tensors keep theirs. null keeps each tensor's own dtype.",
        examples=["bfloat16"],
    )
    max_shard_size: str | int = Field(
        default="5GB",
        description="Largest shard file: bytes, or \"5GB\" (10^9), \"500MB\", \"1GiB\" (2^30); "
        "a larger model is written as model-0000i-of-0000N.safetensors with an index.",
        examples=["5GB"],
    )
    experts: ExpertLayout | None = Field(
        default=None,
        description="How a mixture of experts' expert weights are written: \"per_expert\", one "
        "tensor per expert (the Hub's layout: Mixtral's block_sparse_moe.experts.N.w1, "
        "Qwen-MoE's mlp.experts.N.gate_proj...), or \"packed\", one tensor per projection for "
        "all of a layer's experts (mlp.experts.gate_up_proj, mlp.experts.down_proj: what "
        "transformers 5's modules hold). Both load with from_pretrained. null keeps the "
        "source's layout; a model without experts is written as it is either way.",
        examples=["packed"],
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _short_spellings(cls, value: object) -> object:
        return float_dtype_name(value)


class SafetensorsExporter(Exporter):
    format: ClassVar[str] = "safetensors"
    spec_type: ClassVar[type[ExportSpec]] = SafetensorsSpec
    producers: ClassVar[Producers] = Producers(distributions=("safetensors",))

    def plan(self, spec: ExportSpec, inputs: PlanInputs) -> ExportPlan:
        """The writer's ring of buffers, and transformers running the export when verified
        (:func:`service.exporters.safetensors.plan.plan_safetensors`)."""
        return plan_safetensors(_safetensors_spec(spec), inputs)

    def needs(self, spec: ExportSpec) -> Needs:
        """The source's reference outputs: the export is checked by running it through
        transformers (:meth:`verify`), not by reading it back."""
        return Needs(reference=True)

    def modules(self) -> tuple[str, ...]:
        """The writer and the parity check: most jobs export safetensors, verified."""
        return ("service.exporters.safetensors.writer", "service.exporters.safetensors.verify")

    def check(
        self, spec: ExportSpec, config: dict[str, Any] | None, settings: Settings | None = None
    ) -> None:
        """Reject an unparseable ``max_shard_size`` at submission time."""
        parse_size(_safetensors_spec(spec).max_shard_size)

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        from service.exporters.safetensors.writer import export_safetensors

        sspec = _safetensors_spec(spec)
        return export_safetensors(
            inputs, out_dir, ctx, dtype_name=sspec.dtype, max_shard_size=sspec.max_shard_size,
            experts=sspec.experts,
        )  # fmt: skip

    def verify(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> dict[str, Any]:
        """Stream the written model through its forward and compare with the source's outputs,
        within the tolerance of the export's dtype (the source's dtype when not cast)."""
        from service.exporters.safetensors.verify import verify_safetensors_export

        dtype = _safetensors_spec(spec).dtype or _source_dtype(inputs.checkpoint)
        return verify_safetensors_export(
            inputs.checkpoint,
            out_dir,
            dtype,
            ctx,
            reference=inputs.reference,
            max_memory=inputs.max_memory,
        )


def _source_dtype(checkpoint: Checkpoint) -> str:
    """The floating dtype holding most of the checkpoint's bytes."""
    counts: Counter[str] = Counter()
    for info in checkpoint.reader.tensor_infos():
        if info.dtype.is_floating_point:
            counts[dtype_name(info.dtype)] += info.nbytes
    return counts.most_common(1)[0][0] if counts else "float32"


def _safetensors_spec(spec: ExportSpec) -> SafetensorsSpec:
    if not isinstance(spec, SafetensorsSpec):
        raise InvalidRequest(f"not a safetensors export spec: {spec.format}")
    return spec


exporter = register(SafetensorsExporter())
