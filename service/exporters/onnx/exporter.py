"""ONNX export through torch's dynamo exporter, with weights streamed from the offload store.

The graph is captured from a copy of the job's one meta build: ``torch.onnx.export(...,
dynamo=True)`` traces with fake tensors and never runs a kernel, so a 70B model's graph costs
no weight memory. A decoder is traced with two layers and its further layers are stamped from
the second (:mod:`service.exporters.onnx.stamp`), so capture time does not grow with depth;
``traced_layers`` in the manifest says so. Every initializer of the captured graph is then replaced by an onnx-ir
``LazyTensor`` that re-reads its weight from the job's offload store (or the checkpoint) through
the same :class:`~service.shims.torch_to_nnef.CheckpointTensor` the NNEF export uses, and
onnx-ir writes the external data file one tensor at a time, serially, each a block of at most
64 MiB at a time (:mod:`service.exporters.onnx.blocks`), cast block by block; PyTorch's side of
the check multiplies by a block of a weight's rows at a time too. Peak RSS of the job is therefore

    base (torch, transformers, onnx: ~0.35 GiB) + the captured graph (~4.5 MiB per layer)
    + min(64 MiB, the largest tensor), twice when cast (the block read and its cast)

whatever the weights' total (bench/export_onnx.py shows it at two sizes).

Tasks, in the layout optimum and onnxruntime-genai consume:

``text-generation-with-past`` (causal LMs)
    inputs ``input_ids`` [batch, sequence_length], ``attention_mask`` [batch,
    total_sequence_length], ``position_ids`` [batch, sequence_length],
    ``past_key_values.{i}.key|value`` [batch, kv_heads, past_sequence_length, head_dim];
    outputs ``logits`` [batch, sequence_length, vocab] and ``present.{i}.key|value``.
``feature-extraction`` (encoders)
    inputs ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the model takes
    them) [batch, sequence_length]; output ``last_hidden_state``.

onnxruntime then runs the files in a child process (:mod:`service.exporters.onnx.verify`): it
reads every weight into RAM, the job must not.

Output directory::

    model.onnx               the graph; every initializer is external
    model.onnx_data          the weights, one tensor after the other (onnx-ir's layout)
    config.json, tokenizer*  the checkpoint's auxiliary files, as-is
    genai_config.json        layout "genai" (the default for causal LMs): what
                             onnxruntime_genai.Model reads (:mod:`service.exporters.onnx.genai`)

Causal LMs may have int4/int8 weights (onnxruntime's ``MatMulNBits``, quantized slice by slice
as they stream: :mod:`service.exporters.onnx.quantize`).

Why one module of over 450 lines: the spec, the graph capture, the streamed initializers, the
save and the two task wrappers (:func:`_causal_lm_with_past`, :func:`_feature_extraction`) that
give the graph the input/output layout above are each used only by this export, and the layout is
easier to check against the list above when it is read in one place. What ONNX shares with NNEF
lives in :mod:`service.exporters.common`; what runs in onnxruntime lives in
:mod:`service.exporters.onnx.verify`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import shutil
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from service.errors import ExportFailed, InvalidRequest, UnsupportedExport
from service.exporters.base import (
    ExportInputs,
    ExportResult,
    ExportSpec,
    Producers,
    float_dtype_name,
    register,
)
from service.exporters.common.aux_files import copy_aux_files
from service.exporters.common.families import (
    ENCODER_TYPES,
    GraphExporter,
    is_causal_lm,
    refuse_multimodal,
)
from service.exporters.onnx.blocks import in_store
from service.exporters.onnx.genai import write_genai_config
from service.exporters.onnx.plan import plan_onnx
from service.exporters.onnx.quantize import (
    NBits,
    QuantizedWeights,
    gather_quantized,
    quantize_matmuls,
)
from service.plan import ExportPlan, PlanInputs
from service.stage import Phase
from service.tensors import dtype_name

if TYPE_CHECKING:
    import onnx_ir as ir
    import torch
    from torch import nn

    from service.config import Settings
    from service.stage import JobContext
    from service.verification.parity import ParityReport

LOGGER = logging.getLogger(__name__)

MODEL_NAME = "model.onnx"
DATA_NAME = "model.onnx_data"

Task = Literal["text-generation-with-past", "feature-extraction"]

MOE_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})
"""MoE decoders: captured with transformers' ``batched_mm`` experts
(:mod:`service.shims.transformers_capture`), whose expert matrices are gathered per token, not
multiplied as linear layers, so they take float weights only."""

DECODER_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
    "granite", "stablelm", "starcoder2", "exaone4", "internlm3", "gpt_neox", "cohere", "falcon",
}) | MOE_TYPES  # fmt: skip
"""Causal LMs whose capture by one mechanism (transformers' module traced on meta by the dynamo
exporter, with a DynamicCache) is checked in onnxruntime and onnxruntime-genai, family by family,
by ``tests/integration/exporters/test_families.py``; any other is refused at submission."""


class ONNXSpec(ExportSpec):
    """ONNX for onnxruntime: `model.onnx` + `model.onnx_data`, run and compared with PyTorch."""

    format: Literal["onnx"] = "onnx"
    dtype: Literal["float32", "float16"] | None = Field(
        default=None,
        description="Weights and compute dtype (also spelled f32, f16; any case); default "
        "float16 for a float16 checkpoint, else float32 (onnxruntime's CPU kernels have no "
        "bfloat16 matmul)",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _short_spellings(cls, value: object) -> object:
        return float_dtype_name(value)

    task: Task | None = Field(
        default=None,
        description="Default from the architecture: text-generation-with-past for causal "
        "LMs, feature-extraction for encoders",
    )
    prompt_tokens: int = Field(default=4, ge=1, le=128, description="Causal LMs: prompt length")
    decode_steps: int = Field(
        default=3, ge=0, le=32, description="Causal LMs: greedy steps verified with the KV cache"
    )
    sequence_length: int = Field(default=8, ge=1, le=512, description="Encoders: input length")
    verify: bool = Field(default=True, description="Run the model in onnxruntime and compare")
    atol: float | None = Field(default=None, gt=0, description="Default by dtype")
    rtol: float | None = Field(
        default=None, ge=0, description="Relative tolerance (of max |reference|); default by dtype"
    )
    weights: Literal["float", "int4", "int8"] = Field(
        default="float",
        description="Causal LMs: float keeps every weight in dtype; int4/int8 write each linear "
        "layer's weight (the output head included) as onnxruntime's MatMulNBits, block-wise "
        "round-to-nearest, byte for byte what onnxruntime's own MatMulNBitsQuantizer writes. "
        "The embedding, as onnxruntime-genai's model builder does: at int4 a tied embedding "
        "reads the head's quantized blocks (GatherBlockQuantized), otherwise it stays float",
    )
    block_size: Literal[16, 32, 64, 128, 256] | None = Field(
        default=None,
        description="int4/int8: weights per quantization block along the input dimension; "
        "default 32 (onnxruntime-genai's model builder's)",
    )
    symmetric: bool | None = Field(
        default=None,
        description="int4/int8: blocks centred on zero (no zero point) or with a zero point "
        "each (asymmetric); default true (the model builder's)",
    )
    layout: Literal["genai", "optimum"] | None = Field(
        default=None,
        description="Causal LMs: genai adds genai_config.json so that onnxruntime_genai.Model "
        "loads the directory (and is checked in its generator); optimum is the graph, config "
        "and tokenizer alone, as optimum.onnxruntime loads them. Both hold the same graph. "
        "Default genai for a causal LM",
    )

    @model_validator(mode="after")
    def _quantization_fields(self) -> ONNXSpec:
        if self.weights == "float" and (self.block_size is not None or self.symmetric is not None):
            raise ValueError('"block_size" and "symmetric" apply to "weights": "int4" or "int8"')
        return self

    def nbits(self) -> NBits | None:
        """The quantization asked for (None: float weights)."""
        if self.weights == "float":
            return None
        return NBits(
            bits=4 if self.weights == "int4" else 8,
            block_size=self.block_size or 32,
            symmetric=True if self.symmetric is None else self.symmetric,
        )


def resolve_task(config: dict[str, Any], task: Task | None) -> Task:
    """The task to export ``config``'s model as; :class:`UnsupportedExport` when it cannot be.

    Checked at submission, from config.json alone: a causal LM (``*ForCausalLM``) of a tested
    family exports as ``text-generation-with-past``, an encoder of a tested family as
    ``feature-extraction``."""
    model_type = str(config.get("model_type") or "")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    causal = is_causal_lm(config)
    natural: Task | None = None
    if causal and model_type in DECODER_TYPES:
        natural = "text-generation-with-past"
    elif not causal and model_type in ENCODER_TYPES:
        natural = "feature-extraction"
    if natural is None:
        kind = "causal LM" if causal else "model"
        supported = sorted(DECODER_TYPES) if causal else sorted(ENCODER_TYPES)
        raise UnsupportedExport(
            f"ONNX export does not support the {kind} type {model_type or 'unknown'!r} "
            f"(supported: {', '.join(supported)})"
        )
    if task is not None and task != natural:
        raise UnsupportedExport(
            f"task {task!r} does not fit a {model_type} {architectures or ['model']}: "
            f"it exports as {natural!r}"
        )
    return natural


class ONNXExporter(GraphExporter):
    format: ClassVar[str] = "onnx"
    spec_type: ClassVar[type[ExportSpec]] = ONNXSpec
    producers: ClassVar[Producers] = Producers(
        distributions=("onnx", "onnx-ir", "onnxscript", "onnxruntime", "onnxruntime-genai")
    )

    def plan(self, spec: ExportSpec, inputs: PlanInputs) -> ExportPlan:
        """The graph capture, the largest tensor and onnxruntime mapping every weight
        (:func:`service.exporters.onnx.plan.plan_onnx`)."""
        return plan_onnx(_onnx_spec(spec), inputs)

    def check(
        self, spec: ExportSpec, config: dict[str, Any] | None, settings: Settings | None = None
    ) -> None:
        ospec = _onnx_spec(spec)
        if config is None:
            raise UnsupportedExport("ONNX export builds the model graph and needs a config.json")
        refuse_multimodal(config, "ONNX")
        task = resolve_task(config, ospec.task)
        model_type = str(config.get("model_type") or "")
        if ospec.weights != "float" and model_type in MOE_TYPES:
            raise UnsupportedExport(
                f"ONNX {ospec.weights} weights are not available for the MoE family "
                f"{model_type!r}: its experts are gathered per token, not linear layers that "
                "MatMulNBits replaces, and would stay float; export it with float weights"
            )
        if task != "text-generation-with-past" and (
            ospec.weights != "float" or ospec.layout is not None
        ):
            raise UnsupportedExport(
                f"ONNX {ospec.weights} weights and a layout apply to causal LMs, not to {task}"
            )

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        return export_onnx(_onnx_spec(spec), inputs, out_dir, ctx)


def _onnx_spec(spec: ExportSpec) -> ONNXSpec:
    if not isinstance(spec, ONNXSpec):
        raise InvalidRequest(f"not an ONNX export spec: {spec.format}")
    return spec


def export_onnx(
    spec: ONNXSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
) -> ExportResult:
    """Export the job's checkpoint to ``out_dir`` (see the module docstring for its layout).

    The graph comes from a copy of ``inputs.skeleton`` (the job's meta build), the weights from
    ``inputs.store`` (the job's offload store); called alone, with neither, it builds on meta
    itself and reads the checkpoint."""
    import torch

    from service.exporters.common import offloaded_model as off
    from service.exporters.onnx.verify import ensure_ort_fits
    from service.offload.build import build_on_meta
    from service.shims.transformers_capture import plain_linears

    checkpoint = inputs.checkpoint
    if checkpoint.config is None:
        raise UnsupportedExport("ONNX export builds the model graph and needs a config.json")
    task = resolve_task(checkpoint.config, spec.task)
    started = time.monotonic()
    work = ctx.work_dir / f"onnx-{uuid.uuid4().hex[:8]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx.set_phase(Phase.EXPORT, total=None, unit="bytes")
    timings: dict[str, float] = {}
    dtype = getattr(torch, spec.dtype) if spec.dtype else off.export_dtype(checkpoint)
    on_read = off.read_hook(ctx, "onnx_bytes_read")
    try:
        # Writing and verifying read every weight twice.
        with off.page_cache_kept(checkpoint.reader):
            skeleton = inputs.skeleton
            if skeleton is None:
                skeleton = build_on_meta(checkpoint, ctx.settings).model
            weights = off.offloaded_model(
                skeleton, checkpoint, offload_dir=work / "offload", store=inputs.store,
                hook=on_read, dtype=dtype,
            )  # fmt: skip
            plain_linears(weights.module)  # the reference runs Falcon's linears as nn.Linear
            if spec.verify:
                # Fail before exporting, not after: onnxruntime will need every weight in RAM.
                ensure_ort_fits(weights.weight_bytes, ctx.settings.ort_max_memory)
            timings["capture"] = time.monotonic()
            graph = capture_graph(skeleton, task, dtype)
            ctx.check_abort()
            attach_weights(graph.model, weights.module)
            nbits = spec.nbits()
            quantized: QuantizedWeights | None = None
            if nbits is not None:
                done = quantize_matmuls(
                    graph.model.graph, nbits, _rows_of(graph.model), work / "nbits-spool"
                )
                gathered = gather_quantized(graph.model.graph, nbits, done)
                quantized = QuantizedWeights(nbits, tuple(q.name for q in done), tuple(gathered))
            timings["write"] = time.monotonic()
            _save(graph.model, out_dir)
            ctx.check_abort()
            files = [MODEL_NAME, DATA_NAME, *copy_aux_files(checkpoint, out_dir)]
            layout = _layout(spec, task)
            if layout == "genai":
                files.append(
                    write_genai_config(checkpoint.config, graph.inputs, out_dir, MODEL_NAME)
                )
            report = None
            timings["verify"] = time.monotonic()
            if spec.verify:
                report = _verify(spec, task, weights.module, dtype, out_dir, work, ctx, quantized)
                independent = inputs.independent
                causal = task == "text-generation-with-past"
                if causal and independent is not None and independent.chunks is not None:
                    figures = _check_logits(independent, dtype, out_dir, work, ctx, nbits is None)
                    key = "logits" if nbits is None else "quality"
                    report = dataclasses.replace(report, extra={**report.extra, key: figures})
            timings["end"] = time.monotonic()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = _summary(task, dtype, graph, weights.weight_bytes, out_dir, started, timings)
    summary["layout"] = layout
    summary["weights"] = _weights_summary(spec, quantized)
    summary["verify"] = report.summary() if report is not None else None
    return ExportResult(files=files, summary=summary)


def _layout(spec: ONNXSpec, task: Task) -> Literal["genai", "optimum"] | None:
    """The package's layout: genai unless optimum is asked for (None for an encoder)."""
    if task != "text-generation-with-past":
        return None
    return spec.layout or "genai"


def _weights_summary(spec: ONNXSpec, quantized: QuantizedWeights | None) -> dict[str, Any]:
    """The manifest's account of the weights' encoding."""
    if quantized is None:
        return {"type": "float"}
    nbits = quantized.scheme
    gathered = bool(quantized.gathered)
    return {
        "type": spec.weights, "op": "com.microsoft.MatMulNBits", "bits": nbits.bits,
        "block_size": nbits.block_size, "symmetric": nbits.symmetric, "method": "rtn",
        "quantized_matmuls": len(quantized.matmuls),
        "embedding": "com.microsoft.GatherBlockQuantized on the tied head's blocks"
        if gathered else "float",
        "float": "norms, biases" if gathered else "embedding, norms, biases",
    }  # fmt: skip


def _rows_of(model: ir.Model) -> Any:
    """For :func:`~service.exporters.onnx.quantize.quantize_matmuls`: a weight's rows in the
    export's dtype, read from the offload store a slice at a time (else evaluated once)."""

    def rows_of(name: str) -> tuple[Any, int]:
        value = model.graph.initializers[name]
        tensor: Any = value.const_value
        assert value.dtype is not None
        target = _torch_dtype(value.dtype)
        source = getattr(tensor, "_source", None)
        stored = in_store(source) if source is not None else None
        hook = getattr(source, "hook", None)
        if stored is not None:
            store, key = stored

            def rows(start: int, stop: int) -> Any:
                part = store.load_rows(key, start, stop, dtype=target)
                if hook is not None:
                    hook(part.nbytes)
                return part.contiguous().numpy()

            return rows, target.itemsize
        whole: list[Any] = []

        def evaluated(start: int, stop: int) -> Any:
            if not whole:
                whole.append(tensor.numpy())
            return whole[0][start:stop]

        return evaluated, target.itemsize

    return rows_of


def _summary(
    task: str,
    dtype: Any,
    graph: CapturedGraph,
    weight_bytes: int,
    out_dir: Path,
    started: float,
    timings: dict[str, float],
) -> dict[str, Any]:
    """The export's entry in manifest.json (its ``verify`` added by the caller)."""
    import torch

    return {
        "task": task,
        "dtype": dtype_name(dtype),
        "opset": graph.opset,
        "traced_layers": graph.traced_layers,
        "inputs": graph.inputs,
        "outputs": graph.outputs,
        "weight_bytes": weight_bytes,
        "data_bytes": (out_dir / DATA_NAME).stat().st_size,
        "torch_version": str(torch.__version__),
        "onnxruntime_version": version("onnxruntime"),
        "seconds": round(time.monotonic() - started, 2),
        "phase_seconds": {
            phase: round(timings[after] - timings[phase], 2)
            for phase, after in (("capture", "write"), ("write", "verify"), ("verify", "end"))
        },
    }


class CapturedGraph:
    """The ONNX model captured on meta (initializers without data) and its I/O signature;
    ``traced_layers`` of the decoder were traced by dynamo, the others stamped (None: an
    encoder, or every layer traced)."""

    def __init__(self, model: ir.Model, traced_layers: int | None = None) -> None:
        self.model = model
        self.traced_layers = traced_layers
        self.opset = int(model.opset_imports.get("", 0))
        self.inputs = {v.name: _shape(v) for v in model.graph.inputs if v.name}
        self.outputs = {v.name: _shape(v) for v in model.graph.outputs if v.name}


def _shape(value: ir.Value) -> list[int | str]:
    shape = value.shape
    if shape is None:
        return []
    return [d if isinstance(d, int) else str(d.value) for d in shape]


def capture_graph(skeleton: nn.Module, task: Task, dtype: torch.dtype) -> CapturedGraph:
    """Trace a meta copy of ``skeleton`` in ``dtype`` with the dynamo exporter (no kernel runs).

    Parameters, buffers and example inputs all live on ``meta`` so that tracing never mixes
    devices; each initializer of the result is named after the module tensor it comes from. A
    decoder of more than two layers of one kind is traced with two, and its further layers are
    stamped from the second (:mod:`service.exporters.onnx.stamp`): capture time flat in depth.
    When the two captured layers differ beyond their names, the model is traced whole."""
    from service.exporters.onnx import stamp

    config: Any = skeleton.config
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    kinds = set(getattr(config, "layer_types", None) or ())
    if task == "text-generation-with-past" and layers > stamp.CAPTURED_LAYERS and len(kinds) <= 1:
        try:
            names = stamp.layer_names(skeleton, _WRAPPED.rstrip("."))
            model = _trace(_shallow_copy(skeleton, names.weights), task, dtype)
            stamp.stamp_layers(model, names, layers)
            return CapturedGraph(model, traced_layers=stamp.CAPTURED_LAYERS)
        except stamp.NotStampable as exc:
            LOGGER.warning("ONNX: tracing all %d layers: %s", layers, exc)
    return CapturedGraph(_trace(copy.deepcopy(skeleton), task, dtype))


def _shallow_copy(skeleton: nn.Module, layers_name: str) -> nn.Module:
    """A copy of ``skeleton`` with its first :data:`~service.exporters.onnx.stamp.CAPTURED_LAYERS`
    decoder layers only (the others are not copied) and a config that says so."""
    from torch import nn

    from service.exporters.onnx.stamp import CAPTURED_LAYERS

    layer_list = skeleton.get_submodule(layers_name)
    assert isinstance(layer_list, nn.ModuleList)
    try:  # the job's skeleton lends its list of layers, truncated, for the copy only
        skeleton.set_submodule(layers_name, nn.ModuleList(list(layer_list)[:CAPTURED_LAYERS]))
        module = copy.deepcopy(skeleton)
    finally:
        skeleton.set_submodule(layers_name, layer_list)
    config: Any = module.config
    config.num_hidden_layers = CAPTURED_LAYERS
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:CAPTURED_LAYERS]
    return module


def _trace(module: nn.Module, task: Task, dtype: torch.dtype) -> ir.Model:
    """The dynamo exporter's graph of ``module`` (a copy, changed here) with its initializers
    named as the module's tensors."""
    import torch

    from service.shims.transformers_capture import prepare_for_capture

    module = module.eval()
    prepare_for_capture(module)  # attention, MoE experts, Falcon's QKV split
    module = module.to(device="meta", dtype=dtype)
    if task == "text-generation-with-past":
        wrapper = _causal_lm_with_past(module)
    else:
        wrapper = _feature_extraction(module)
    names, args, dynamic = wrapper.example()
    output_names = wrapper.output_names()
    try:
        program = torch.onnx.export(
            wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=names,
            output_names=output_names, optimize=False, verbose=False, report=False,
        )  # fmt: skip
    except Exception as exc:  # torch.onnx raises its own tree and torch.export's errors
        raise ExportFailed(f"torch.onnx could not capture the model: {exc}") from exc
    if program is None:  # pragma: no cover - dynamo=True always returns a program
        raise ExportFailed("torch.onnx returned no program")
    model = program.model
    for value in list(model.graph.initializers.values()):
        if value.name and value.name.startswith(_WRAPPED):
            model.graph.initializers.pop(value.name)
            value.name = value.name.removeprefix(_WRAPPED)
            model.graph.register_initializer(value)
    return model


_WRAPPED = "model."
"""The prefix the wrappers' ``model`` attribute adds to every initializer name."""


def attach_weights(model: ir.Model, weights: nn.Module) -> None:
    """Give every initializer a lazy tensor reading the weight of the same name in ``weights``.

    ``weights`` is the offloaded copy of the model (its tensors re-read the store at each
    access). Initializers are read when onnx-ir writes them, one at a time, then dropped."""

    tensors: dict[str, Any] = dict(weights.named_parameters(remove_duplicate=False))
    tensors.update(weights.named_buffers(remove_duplicate=False))
    missing = []
    for name, value in model.graph.initializers.items():
        source = tensors.get(name)
        if source is None or value.dtype is None or value.shape is None:
            missing.append(name)
            continue
        value.const_value = _streamed_tensor_type()(
            source, _reader(source, value.dtype), dtype=value.dtype, shape=value.shape, name=name
        )
    if missing:
        raise ExportFailed(
            f"the ONNX graph has {len(missing)} constants the model does not hold: "
            + ", ".join(sorted(missing)[:5])
        )


def _torch_dtype(dtype: ir.DataType) -> torch.dtype:
    import numpy as np
    import torch

    return torch.from_numpy(np.empty(0, dtype=dtype.numpy())).dtype


@functools.cache
def _streamed_tensor_type() -> type[Any]:
    """``LazyTensor`` whose ``tofile`` writes its weight a block at a time
    (:func:`service.exporters.onnx.blocks.weight_blocks`).

    onnx-ir writes external data with ``tensor.tofile(file)``; a plain ``LazyTensor`` would
    evaluate the whole weight first, and cast it whole (a 70B model's embedding is 4 GiB in
    float32, beside its 2 GiB bfloat16 read). ``numpy()``/``tobytes()`` still evaluate the
    whole tensor; the export never calls them for a weight."""
    import onnx_ir as ir

    class StreamedTensor(ir.LazyTensor):
        def __init__(self, source: Any, func: Any, **kwargs: Any) -> None:
            super().__init__(func, **kwargs)
            self._source = source

        def tofile(self, file: Any) -> None:
            from service.exporters.onnx import blocks as weight_blocks

            blocks = weight_blocks.weight_blocks(
                self._source, _torch_dtype(self.dtype), weight_blocks.WRITE_BLOCK_BYTES
            )
            if blocks is None:
                super().tofile(file)
                return
            for block in blocks:
                file.write(block.numpy().data)
                del block

    return StreamedTensor


def _reader(source: Any, dtype: ir.DataType) -> Any:
    import onnx_ir as ir

    def read() -> ir.Tensor[Any]:
        import torch

        from service.shims.torch_to_nnef import CheckpointTensor

        with torch.no_grad():
            value = source.reload() if isinstance(source, CheckpointTensor) else source.detach()
            value = value.as_subclass(torch.Tensor)
            value = value.to(_torch_dtype(dtype)).contiguous()  # cast on read
        return ir.Tensor(value.numpy(), dtype=dtype)

    return read


def _save(model: ir.Model, out_dir: Path) -> None:
    """Fold the graph's own constants and drop its no-ops (:mod:`~service.exporters.onnx.
    simplify`), then write the graph and its external data.

    Nodes reading a weight are never folded: each weight stays one lazy tensor under its module
    name (a folded transpose would be a nameless copy held in RAM until written); onnxruntime
    pre-packs them when it loads the model. ``ir.save`` then writes the weights serially (one
    worker, one tensor in flight) into a temporary file that replaces ``model.onnx_data`` when
    complete."""
    import onnx_ir as ir

    from service.exporters.onnx.simplify import simplify

    weights = set(model.graph.initializers)

    def should_fold(node: ir.Node) -> bool | None:
        return False if any(v is not None and v.name in weights for v in node.inputs) else None

    try:
        simplify(model, should_fold)
    except Exception as exc:  # the optimizer wraps its passes' errors in PassError
        raise ExportFailed(f"onnxscript could not optimize the graph: {exc}") from exc
    from service.exporters.onnx.mapped import ALIGNMENT, weights_read_in_place

    weights_read_in_place(model.graph)
    ir.save(
        model, out_dir / MODEL_NAME, external_data=DATA_NAME,
        max_workers=1, max_in_flight_bytes=1, alignment=ALIGNMENT,
    )  # fmt: skip


def _verify(
    spec: ONNXSpec,
    task: Task,
    module: nn.Module,
    dtype: torch.dtype,
    out_dir: Path,
    work: Path,
    ctx: JobContext,
    quantized: QuantizedWeights | None,
) -> ParityReport:
    from service.exporters.onnx import verify as ver
    from service.verification.parity import tolerance_for

    tolerance = tolerance_for("runtime", dtype).overridden(spec.atol, spec.rtol)
    atol, rtol = tolerance.atol, tolerance.rtol
    ver.ensure_ort_fits((out_dir / DATA_NAME).stat().st_size, ctx.settings.ort_max_memory)
    if task == "text-generation-with-past":
        ctx.set_phase(Phase.VERIFY, total=spec.decode_steps + 1, unit="steps")
        report = ver.verify_causal_lm(
            out_dir / MODEL_NAME, module, spec.prompt_tokens, spec.decode_steps, atol, rtol,
            work=work / "verify", check_abort=ctx.check_abort, quantized=quantized,
            genai=_layout(spec, task) == "genai",
        )  # fmt: skip
        ctx.advance(spec.decode_steps + 1)
        return report
    ctx.set_phase(Phase.VERIFY, total=1, unit="steps")
    report = ver.verify_encoder(
        out_dir / MODEL_NAME, module, spec.sequence_length, atol, rtol,
        work=work / "verify", check_abort=ctx.check_abort,
    )  # fmt: skip
    ctx.advance(1)
    return report


def _check_logits(
    reference: Any, dtype: torch.dtype, out_dir: Path, work: Path, ctx: JobContext, judged: bool
) -> dict[str, Any]:
    from service.exporters.onnx import verify as ver

    return ver.check_logits(
        out_dir / MODEL_NAME, dtype_name(dtype), reference, work / "verify", ctx.check_abort,
        judged=judged,
    )  # fmt: skip


def _module_inputs(module: nn.Module) -> list[str]:
    import inspect

    return list(inspect.signature(module.forward).parameters)


def kv_layout(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config, GQA included."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv_heads, head_dim


def _causal_lm_with_past(module: nn.Module) -> Any:
    import torch
    from transformers.cache_utils import DynamicCache

    config: Any = module.config
    layers, kv_heads, head_dim = kv_layout(config)

    class CausalLMWithPast(torch.nn.Module):
        """Flat tensors in and out, in optimum's names: the form ONNX consumers feed."""

        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            # A cache of full layers, whatever the config says: transformers' sliding-window
            # layer crops its past to the window, which the trace turns into shapes that
            # onnxruntime refuses once the context passes the window. Full layers keep the
            # whole past and the mask still hides what lies beyond the window (optimum's layout).
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True,
            )  # fmt: skip
            flat: list[torch.Tensor] = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

        def example(self) -> tuple[list[str], tuple[torch.Tensor, ...], tuple[Any, ...]]:
            # Sizes other than 0 and 1, which torch.export would specialize.
            batch, seq, past_len = 2, 3, 5
            meta = torch.device("meta")
            dtype = next(iter(self.model.parameters())).dtype
            ids = torch.zeros(batch, seq, dtype=torch.int64, device=meta)
            positions = torch.zeros(batch, seq, dtype=torch.int64, device=meta)  # not `ids`:
            # torch.export would take one tensor passed twice for one input.
            mask = torch.zeros(batch, past_len + seq, dtype=torch.int64, device=meta)
            cache = [
                torch.zeros(batch, kv_heads, past_len, head_dim, dtype=dtype, device=meta)
                for _ in range(2 * layers)
            ]
            b = torch.export.Dim("batch")
            s = torch.export.Dim("sequence_length")
            p = torch.export.Dim("past_sequence_length")
            t = torch.export.Dim("total_sequence_length")
            dynamic = ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, tuple({0: b, 2: p} for _ in cache))
            names = ["input_ids", "attention_mask", "position_ids"]
            names += [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
            return names, (ids, mask, positions, *cache), dynamic

        def output_names(self) -> list[str]:
            return ["logits"] + [
                f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")
            ]

    return CausalLMWithPast().eval()


def _feature_extraction(module: nn.Module) -> Any:
    import torch

    accepted = _module_inputs(module)
    names: list[str] = [
        n for n in ("input_ids", "attention_mask", "token_type_ids") if n in accepted
    ]

    class FeatureExtraction(torch.nn.Module):
        """Token ids (and masks) in, ``last_hidden_state`` out."""

        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            kwargs = dict(zip(names, tensors, strict=True))
            hidden: torch.Tensor = self.model(**kwargs, return_dict=True).last_hidden_state
            return hidden

        def example(self) -> tuple[list[str], tuple[torch.Tensor, ...], tuple[Any, ...]]:
            batch, seq = 2, 5
            args = tuple(torch.zeros(batch, seq, dtype=torch.int64, device="meta") for _ in names)
            b = torch.export.Dim("batch")
            s = torch.export.Dim("sequence_length")
            return names, args, (tuple({0: b, 1: s} for _ in names),)

        def output_names(self) -> list[str]:
            return ["last_hidden_state"]

    return FeatureExtraction().eval()


register(ONNXExporter())
