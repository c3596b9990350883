"""NNEF export for tract, through torch-to-nnef, with weights streamed from the offload store.

The model is a copy of the job's one meta build (no weight memory) and each weight is a
torch-to-nnef ``OffloadedTensor`` reading from the job's offload store, or the checkpoint
(:mod:`service.exporters.common.offloaded_model`), so peak memory is the largest tensor or two,
not the model. Causal LMs go through torch-to-nnef's LLM exporter (the one behind ``dump_llm``:
KV cache inputs/outputs, symbolic ``S``/``P`` axes); other models through
``export_model_to_nnef``.
``q4_0`` applies torch-to-nnef's ``min_max_q4_0`` compression, whose blocks stay offloaded (in
the job's work dir) while being computed.

torch-to-nnef is used with its traps closed: weights come from the project's safe readers (its
``.bin`` loader may unpickle without restriction), every ``torch.load`` it makes is weights-only,
``trust_remote_code`` follows the settings, its ``mkdtemp`` directories live in the job's work
dir and are removed, and its tract CLI is :mod:`service.exporters.nnef.tract_cli` (it would
otherwise download a binary). tract itself (PyPI bindings) then verifies the archive in a child
process (:mod:`service.exporters.nnef.verify`): tract holds every weight in RAM, the job must not.

Output directory::

    model.nnef.tgz           the NNEF archive (tar, gzip level 0: weights do not compress)
    io.json                  inputs/outputs, dtypes, symbolic axes, tract extensions, compression
    example_inputs.npz       one input set (graph order) and PyTorch's outputs for it,
    example_outputs.npz      usable with ``tract ... run --input-from-bundle/--assert-output-bundle``
    config.json, tokenizer*  the checkpoint's auxiliary files, as-is

Why one module of over 450 lines: causal LMs and encoders take two different torch-to-nnef
entry points (:func:`_export_causal_lm`, :func:`_export_encoder`), and each call closes the traps
listed above itself; the shared parts (offloaded model, reference outputs, output comparison) are
already in :mod:`service.exporters.common`, tract's CLI in :mod:`.tract_cli` and the check in
:mod:`.verify`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from service.errors import ExportFailed, InvalidRequest, UnsupportedExport
from service.exporters.base import ExportInputs, ExportResult, ExportSpec, Producers, register
from service.exporters.common.aux_files import copy_aux_files
from service.exporters.common.families import (
    ENCODER_TYPES,
    GraphExporter,
    is_causal_lm,
    refuse_multimodal,
)
from service.exporters.nnef.plan import (
    block_weight_bytes,
    nnef_block_limit,
    plan_nnef,
    tract_block_limit,
)
from service.plan import ExportPlan, PlanInputs, VerificationMode
from service.stage import Phase
from service.verification.thresholds import QualityThresholds

if TYPE_CHECKING:
    from service.config import Settings
    from service.exporters.common.offloaded_model import OffloadedModel
    from service.exporters.nnef.verify import IOSpec, TextCheck
    from service.stage import JobContext
    from service.verification.parity import ParityReport
    from service.verification.reference import GreedyReference

LOGGER = logging.getLogger(__name__)

ARCHIVE_NAME = "model.nnef.tgz"
VERIFY_DIR = "verify"
"""The decode check's work directory in the stage; the layer-by-layer check leaves the blocks it
cut in its ``blocks``, which the logits check runs again."""

ARCHIVE_PROPERTIES: dict[str, str] = {"export_cmd": "modelprep"}
"""Properties that replace torch-to-nnef's own in the archive: it records ``" ".join(sys.argv)``
as ``export_cmd``, which in the service is the worker's command line with host paths; an
artifact handed to users must not carry them (as ``_name_or_path`` is scrubbed too)."""
T2N_LOG_LEVEL = logging.WARNING

CAUSAL_LM_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma", "gemma2", "olmo2",
    "granite", "stablelm", "starcoder2", "exaone4", "internlm3", "phi3", "gpt_neox", "cohere",
    "falcon", "mixtral", "qwen2_moe", "qwen3_moe",
})  # fmt: skip
"""Causal LMs whose torch-to-nnef LLM export decodes in tract like PyTorch, in the tests (tiny
ones of each, and real SmolLM2, Qwen2.5 and Gemma 3). torch-to-nnef's LLM exporter takes any
transformers decoder through its default handler; these are the ones checked, with what
:func:`_traceable` and :mod:`service.shims.torch_to_nnef` add (Falcon, GPT-NeoX, StableLM 2's
per-head norms). The mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) export each MoE block
as tract's ``tract_moe_ffn`` op (torch-to-nnef's MoE extractor; tract >= 0.23.9)."""


def check_architecture(config: dict[str, Any]) -> None:
    """Refuse at submission a model type the NNEF export is not tested on, listing those it is,
    and a configuration of a tested one that torch-to-nnef cannot export, naming why.

    Remote-code models (``auto_map``) are judged by ``trust_remote_code`` when the job builds
    them, not here."""
    if "auto_map" in config:
        return
    model_type = str(config.get("model_type") or "")
    causal = is_causal_lm(config)
    supported = CAUSAL_LM_TYPES if causal else ENCODER_TYPES
    if model_type not in supported:
        kind = "causal LM" if causal else "model"
        raise UnsupportedExport(
            f"NNEF export does not support the {kind} type {model_type or 'unknown'!r} "
            f"(supported: causal LMs {', '.join(sorted(CAUSAL_LM_TYPES))}; encoders "
            f"{', '.join(sorted(ENCODER_TYPES))})"
        )
    if model_type == "falcon" and config.get("alibi"):
        raise UnsupportedExport(
            "NNEF export does not support Falcon with ALiBi (alibi: true, as Falcon-RW): "
            "torch-to-nnef's LLM exporter gives the model a 4-D causal mask, and Falcon builds "
            "its ALiBi biases from a 2-D padding mask; Falcon with rotary embeddings exports"
        )


def installed_tract_version() -> str:
    """The tract bindings' version: the only tract this service can verify against."""
    try:
        return version("tract")
    except PackageNotFoundError as exc:  # pragma: no cover - it is a hard dependency
        raise UnsupportedExport("the tract Python bindings are not installed") from exc


class NNEFSpec(ExportSpec):
    """An NNEF archive for tract, through torch-to-nnef, run by tract and compared with PyTorch."""

    format: Literal["nnef"] = "nnef"
    compression: Literal["q4_0"] | None = Field(
        default=None, description="q4_0: torch-to-nnef min_max_q4_0 on Linear weights"
    )
    tract_version: str | None = Field(
        default=None,
        pattern=r"^\d+\.\d+\.\d+$",
        description="Targeted tract version; must be the installed one (default).",
    )
    prompt_tokens: int = Field(default=4, ge=1, le=128, description="Causal LMs: prompt length")
    decode_steps: int = Field(
        default=2, ge=0, le=32, description="Causal LMs: greedy steps verified with the KV cache"
    )
    sequence_length: int = Field(default=8, ge=1, le=512, description="Encoders: input length")
    verify: bool | QualityThresholds = Field(
        default=True,
        description="Run the archive in tract and compare with PyTorch. A q4_0 archive is "
        "compared exactly with PyTorch's run of its own q4_0 weights, and its quality against "
        "the float source reported (KL, p99 KL, top-1, top-1 on decided positions, perplexity "
        "ratio, the share of near ties); with compression, an object of thresholds (max_kl, "
        "max_kl_p99, min_top1, min_decided_top1, max_ppl_ratio) also fails the job below them "
        "(quality_below_threshold)",
        examples=[True, {"max_kl": 0.5, "min_decided_top1": 0.9}],
    )
    atol: float | None = Field(default=None, gt=0, description="Default by dtype/compression")
    rtol: float | None = Field(
        default=None, ge=0, description="Relative tolerance (of max |reference|); default by weights"
    )

    @model_validator(mode="after")
    def _thresholds_need_compression(self) -> NNEFSpec:
        if isinstance(self.verify, QualityThresholds) and self.compression is None:
            raise ValueError(
                '"verify" thresholds judge a compressed archive\'s quality: a float archive is '
                'held to the float runtime\'s bounds (set "compression", or "verify": true)'
            )
        return self

    @property
    def thresholds(self) -> QualityThresholds | None:
        """The quality the request demands, when ``verify`` is an object of thresholds."""
        return self.verify if isinstance(self.verify, QualityThresholds) else None


class NNEFExporter(GraphExporter):
    format: ClassVar[str] = "nnef"
    spec_type: ClassVar[type[ExportSpec]] = NNEFSpec
    producers: ClassVar[Producers] = Producers(distributions=("torch-to-nnef", "tract"))

    def plan(self, spec: ExportSpec, inputs: PlanInputs) -> ExportPlan:
        """The trace, the streamed weights and tract's check, whole or block by block
        (:func:`service.exporters.nnef.plan.plan_nnef`)."""
        return plan_nnef(_nnef_spec(spec), inputs)

    def check(
        self, spec: ExportSpec, config: dict[str, Any] | None, settings: Settings | None = None
    ) -> None:
        nspec = _nnef_spec(spec)
        if config is None:
            raise UnsupportedExport("NNEF export builds the model graph and needs a config.json")
        refuse_multimodal(config, "NNEF")
        check_architecture(config)
        installed = installed_tract_version()
        if nspec.tract_version is not None and nspec.tract_version != installed:
            raise UnsupportedExport(
                f"tract {nspec.tract_version} requested, this service runs tract {installed}"
            )

    def check_files(
        self, spec: ExportSpec, config: dict[str, Any] | None, root: Path, settings: Settings
    ) -> None:
        """:meth:`check`, then refuse at submission a verification tract cannot hold even one
        block at a time (it holds every weight it runs in RAM), naming the numbers, rather than
        in the job."""
        from service.checkpoint.consistency import safetensors_weight_bytes
        from service.checkpoint.headers import local_file_header
        from service.exporters.nnef.verify import ensure_tract_fits
        self.check(spec, config, settings)
        nspec = _nnef_spec(spec)
        weight_bytes = safetensors_weight_bytes(root)
        if nspec.verify and nspec.compression is None and weight_bytes is not None:
            # As the export writes them: float16 stays, anything else becomes float32.
            tensors = [t for f in sorted(root.glob("*.safetensors")) for t in local_file_header(f)]
            sizes = [(t.name, t.numel * (2 if t.dtype == "F16" else 4) if t.floating else t.nbytes)
                     for t in tensors]  # fmt: skip
            limit = tract_block_limit(settings)
            block = block_weight_bytes(sizes, limit) if is_causal_lm(config or {}) else None
            exported = sum(size for _, size in sizes) or weight_bytes
            ensure_tract_fits(exported, settings.tract_max_memory, block)

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        nspec = _nnef_spec(spec)
        self.check(nspec, inputs.checkpoint.config, ctx.settings)
        return export_nnef(nspec, inputs, out_dir, ctx)


def _nnef_spec(spec: ExportSpec) -> NNEFSpec:
    if not isinstance(spec, NNEFSpec):
        raise InvalidRequest(f"not an NNEF export spec: {spec.format}")
    return spec


def export_nnef(
    spec: NNEFSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
) -> ExportResult:
    """Export the job's checkpoint to ``out_dir`` (see the module docstring for its layout).

    The model is a copy of the job's meta build (``inputs.skeleton``) reading its weights from
    the job's offload store (``inputs.store``); called alone, with neither, it builds on meta
    itself and reads the checkpoint."""
    from service.exporters.common import offloaded_model as off
    from service.exporters.nnef.tract_cli import write_launcher
    from service.exporters.nnef.verify import TextCheck, ensure_tract_fits
    from service.offload.build import build_on_meta
    from service.shims import torch_to_nnef as t2n

    checkpoint = inputs.checkpoint

    started = time.monotonic()
    work = ctx.work_dir / f"nnef-{uuid.uuid4().hex[:8]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx.set_phase(Phase.EXPORT, total=None, unit="bytes")

    on_read = off.read_hook(ctx, "nnef_bytes_read")
    try:
        # Tracing, writing and verifying read every weight 4-7 times.
        with (
            off.page_cache_kept(checkpoint.reader),
            t2n.job_tempdir(work / "tmp"),
            t2n.weights_only_unpickling(),
            t2n.checkpoint_tensors_writable(),
            t2n.eager_q4_dequantize(),
            t2n.cache_update_restored(),
            t2n.sliding_window_masks(),
            t2n.cache_heads_from_config(),
            t2n.moe_experts_offloaded(work / "offload"),
            t2n.metadata_from_shells(),
        ):
            launcher = write_launcher(work / "bin")
            offload_dir = work / "offload"
            offload_dir.mkdir()
            skeleton = inputs.skeleton
            if skeleton is None:
                skeleton = build_on_meta(checkpoint, ctx.settings).model
            built = off.offloaded_model(
                skeleton, checkpoint, offload_dir=offload_dir, store=inputs.store, hook=on_read
            )
            _traceable(built.module)
            t2n.read_in_blocks(built.module, nnef_block_limit(ctx.settings))
            mode: VerificationMode = "none"
            if spec.verify and spec.compression is None:
                # Fail before exporting, not after: tract needs every weight it runs in RAM,
                # the whole archive's or, when that does not fit, one block's at a time.
                mode = ensure_tract_fits(
                    built.weight_bytes, ctx.settings.tract_max_memory,
                    _block_bytes(built, ctx.settings),
                )  # fmt: skip
            if built.kind == "causal_lm":
                independent = inputs.independent
                text = None
                if independent is not None and independent.chunks is not None:
                    text = TextCheck(
                        str(built.dtype).removeprefix("torch."), spec.compression, independent,
                        thresholds=spec.thresholds,
                    )
                io, report = _export_causal_lm(
                    spec, built, launcher, work / "stage", out_dir, ctx, mode, text
                )
                if (
                    report is not None and text is not None and "logits" not in report.extra
                ):  # fmt: skip
                    # block by block where the decode check was (the blocks it cut), else whole
                    blocks = work / "stage" / VERIFY_DIR / "blocks" if mode == "layerwise" else None
                    report = _with_logits(
                        report, spec, built, io, independent, out_dir, work, ctx, blocks
                    )
            else:
                io, report = _export_encoder(spec, built, launcher, work / "stage", out_dir, ctx)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    (out_dir / "io.json").write_text(json.dumps(io.to_json(), indent=2))
    files = [ARCHIVE_NAME, "io.json", "example_inputs.npz", "example_outputs.npz"]
    files += copy_aux_files(checkpoint, out_dir)
    summary: dict[str, Any] = {
        "kind": built.kind,
        "compression": spec.compression,
        "dtype": str(built.dtype).removeprefix("torch."),
        "tract_version": io.tract_version,
        "weight_bytes": built.weight_bytes,
        "archive_bytes": (out_dir / ARCHIVE_NAME).stat().st_size,
        "seconds": round(time.monotonic() - started, 2),
        "verify": report.summary() if report is not None else None,
    }
    return ExportResult(files=files, summary=summary)


TRACEABLE_EXPERTS = "batched_mm"
"""The experts implementation a mixture of experts is traced with: transformers 5 picks
``grouped_mm`` on CPU, which the trace rejects in float32 ("Expected inputs of BF16 type");
``batched_mm`` is plain batched matmuls, torch-to-nnef's own default for the models it loads.
The trace replaces each MoE block by tract's ``tract_moe_ffn`` op all the same."""

PLAIN_LINEARS = frozenset({"FalconLinear"})
"""``nn.Linear`` subclasses whose forward is ``input @ self.weight.T + bias`` (Falcon keeps
the two apart to round to bfloat16 between them as its training did): on torch-to-nnef's
offloaded weights ``.T`` fails inside PyTorch (an internal assert of its ``__torch_function__``
dispatch, torch 2.13), and a q4_0 weight transposed in the graph is one tract cannot load.
As ``nn.Linear`` they trace as ``linear``, which both take; in float32 (or float16, where the
bias is added to the rounded product either way) the numbers are the same."""


def _traceable(module: Any) -> None:
    """Make the export's private copy of the model export as it runs where torch-to-nnef or
    tract would not take transformers' own modules: a mixture of experts runs
    :data:`TRACEABLE_EXPERTS` (transformers' public ``get/set_experts_implementation``; a
    model without experts, ``eager``, is left alone), the :data:`PLAIN_LINEARS` become
    ``nn.Linear``, and a ``LayerNorm`` with a weight but no bias gets a zero bias:
    torch-to-nnef (0.24.12) writes a layer norm's affine only when it has both, so StableLM's
    per-head q/k norms (``qk_layernorm``, StableLM 2 12B) lost their weights and tract's
    logits differed from PyTorch's by 0.2 on a tiny model."""
    import torch

    get = getattr(module, "get_experts_implementation", None)
    if callable(get) and get().get("") not in (None, "eager", TRACEABLE_EXPERTS):
        module.set_experts_implementation(TRACEABLE_EXPERTS)
    for sub in module.modules():
        if type(sub).__name__ in PLAIN_LINEARS and isinstance(sub, torch.nn.Linear):
            sub.__class__ = torch.nn.Linear
        elif isinstance(sub, torch.nn.LayerNorm) and sub.weight is not None and sub.bias is None:
            zeros = torch.zeros(sub.normalized_shape, dtype=sub.weight.dtype)
            sub.bias = torch.nn.Parameter(zeros, requires_grad=False)


def _block_bytes(built: OffloadedModel, settings: Settings | None = None) -> int | None:
    """The largest block's weight bytes of a causal LM checked block by block (None for an
    encoder, which is not cut): from the module's parameters, ties counted once, at most the
    block setting (``MODELPREP_TRACT_BLOCK_BYTES``; without settings, whole layers)."""
    if built.kind != "causal_lm":
        return None
    return block_weight_bytes(
        ((name, p.numel() * p.element_size()) for name, p in built.module.named_parameters()),
        tract_block_limit(settings),
    )


class _PromptTokenizer:
    """The tokenizer torch-to-nnef's LLM exporter asks for; it only needs example token ids."""

    def __init__(self, ids: list[int], name: str, vocab_size: int) -> None:
        self.ids, self.name_or_path, self.vocab_size = ids, name, vocab_size

    def __call__(self, text: str, return_tensors: str = "pt") -> Any:
        import torch
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": torch.tensor([self.ids], dtype=torch.int64)})


def _export_causal_lm(
    spec: NNEFSpec,
    built: OffloadedModel,
    launcher: Path,
    stage: Path,
    out_dir: Path,
    ctx: JobContext,
    mode: VerificationMode = "whole",
    text: TextCheck | None = None,
) -> tuple[IOSpec, ParityReport | None]:
    """Export through torch-to-nnef's LLM exporter, then (``spec.verify``) replay PyTorch's
    greedy decode in tract; the whole archive's check also judges the fixed text (``text``)
    in the same tract child, the layer-by-layer one leaves it to :func:`_with_logits`."""
    from torch_to_nnef.compress import DEFAULT_COMPRESSION_REGISTRY
    from torch_to_nnef.exceptions import T2NError
    from torch_to_nnef_llm.config import ExportDirStruct
    from torch_to_nnef_llm.exporter import LLMExporter

    from service.exporters.common.child_process import memory_limit
    from service.exporters.nnef.exact import own_chunk_logits
    from service.exporters.nnef.layerwise import verify_causal_lm_layerwise
    from service.exporters.nnef.verify import verify_causal_lm
    from service.verification.reference import greedy_reference, prompt_ids

    vocab = int(built.config.vocab_size)
    # 16 example tokens: torch-to-nnef traces with 1 token and 2 past ones.
    tokenizer = _PromptTokenizer(prompt_ids(16, vocab), str(built.config.model_type), vocab)
    compression = "min_max_q4_0" if spec.compression == "q4_0" else None
    prompt = prompt_ids(spec.prompt_tokens, vocab)
    expected: GreedyReference | None = None
    try:
        exporter = LLMExporter(built.module, tokenizer, num_logits_to_keep=1)
        target = exporter.build_inference_target(
            tract_specific_path=launcher,
            no_verify=True,
            compression_method=compression,
            compression_registry=DEFAULT_COMPRESSION_REGISTRY,
        )
        target.dump_identity_properties = False
        target.specific_properties = ARCHIVE_PROPERTIES
        # prepare() compresses; the reference must see the weights tract will get, and must run
        # before export_model(), which leaves the module's tensors wrapped for tracing.
        exporter.prepare(
            compression_method=compression,
            compression_registry=DEFAULT_COMPRESSION_REGISTRY,
            wrapper_io_check=False,
            log_level=T2N_LOG_LEVEL,
        )
        ctx.check_abort()
        if spec.verify:
            expected = greedy_reference(
                exporter.hf_model_causal, prompt, spec.decode_steps, record_layers=True,
                record_hidden=mode == "layerwise",
            )
            if text is not None and spec.compression is not None:
                # the exact check's reference: the same compressed model on the fixed text
                text = replace(text, own=own_chunk_logits(
                    exporter.hf_model_causal, text.reference.chunks
                ))  # fmt: skip
        ctx.check_abort()
        # asked before export_model(), which leaves the weights wrapped so that counting their
        # elements (torch-to-nnef's dtype vote) reloads each one whole
        cache_dtype = str(exporter.inputs_dtype).removeprefix("torch.")
        exporter.export_model(
            stage,
            inference_target=target,
            log_level=T2N_LOG_LEVEL,
            check_inference_modes=False,
            sample_generation_total_size=2,
            export_dir_struct=ExportDirStruct.FLAT,
        )
    except (T2NError, RuntimeError, AssertionError, NotImplementedError) as exc:
        raise ExportFailed(f"torch-to-nnef could not export the model: {exc}") from exc
    ctx.check_abort()
    _collect(stage / ARCHIVE_NAME, stage / "tests", out_dir)
    io = _io_spec(out_dir, "causal_lm", target.dynamic_axes, spec)
    # The example npz bundles hold the caches as float32 whatever the model's dtype.
    io.inputs = io.inputs[:1] + [replace(t, dtype=cache_dtype) for t in io.inputs[1:]]
    io.outputs = io.outputs[:1] + [replace(t, dtype=cache_dtype) for t in io.outputs[1:]]
    io.notes = {
        "inputs": "input_ids[1,S] then per layer in_cache_key/value[1,kv_heads,P,head_dim]",
        "outputs": "logits of the last token, then caches extended to P+S",
        "max_positions": int(getattr(built.config, "max_position_embeddings", 0) or 0),
    }
    if expected is None:
        return io, None
    reference = expected

    def run(archive: Path, atol: float, rtol: float, work: Path) -> ParityReport:
        if mode == "layerwise":
            report = verify_causal_lm_layerwise(
                archive, io, reference, atol, rtol, work=work, check_abort=ctx.check_abort,
                block_bytes=tract_block_limit(ctx.settings),
            )  # fmt: skip
        else:
            report = verify_causal_lm(
                archive, io, reference, atol, rtol, work=work, check_abort=ctx.check_abort,
                text=text,
            )  # fmt: skip
        report.extra["tract_max_memory_bytes"] = memory_limit(ctx.settings.tract_max_memory)
        return report

    return io, _verify_archive(
        spec, built, out_dir, stage, ctx, spec.decode_steps + 1, run,
        _block_bytes(built, ctx.settings),
    )  # fmt: skip


def _export_encoder(
    spec: NNEFSpec,
    built: OffloadedModel,
    launcher: Path,
    stage: Path,
    out_dir: Path,
    ctx: JobContext,
) -> tuple[IOSpec, ParityReport | None]:
    import numpy as np
    import torch
    from torch_to_nnef.compress import quantize_weights_min_max_Q4_0
    from torch_to_nnef.exceptions import T2NError
    from torch_to_nnef.export import export_model_to_nnef
    from torch_to_nnef.inference_target.tract import TractNNEF

    from service.exporters.common.offloaded_model import TensorOutputs
    from service.exporters.nnef.verify import verify_encoder
    from service.verification.reference import prompt_ids

    wrapper = TensorOutputs(built.module)
    seq = spec.sequence_length
    vocab = int(getattr(built.config, "vocab_size", 2))
    example = {
        "input_ids": torch.tensor([prompt_ids(seq, vocab)], dtype=torch.int64),
        "attention_mask": torch.ones(1, seq, dtype=torch.int64),
        "token_type_ids": torch.zeros(1, seq, dtype=torch.int64),
    }
    names = [n for n in wrapper.input_names if n in example]
    if "input_ids" not in names:
        raise UnsupportedExport(f"{built.config.model_type} does not take input_ids")
    wrapper.input_names = names
    args = tuple(example[n] for n in names)
    try:
        if spec.compression == "q4_0":
            quantize_weights_min_max_Q4_0(wrapper)
        with torch.no_grad():
            expected = [t.float().as_subclass(torch.Tensor).numpy() for t in wrapper(*args)]
        stage.mkdir(parents=True)
        dynamic_axes = {n: {1: "S"} for n in names}
        target = TractNNEF(
            installed_tract_version(),
            check_io=False,
            dynamic_axes=dynamic_axes,
            specific_tract_binary_path=launcher,
            dump_identity_properties=False,
        ).with_specific_properties(ARCHIVE_PROPERTIES)
        export_model_to_nnef(
            model=wrapper,
            args=args,
            file_path_export=stage / ARCHIVE_NAME,
            inference_target=target,
            input_names=names,
            output_names=wrapper.output_names,
            log_level=T2N_LOG_LEVEL,
        )
    except (T2NError, RuntimeError, AssertionError, NotImplementedError) as exc:
        raise ExportFailed(f"torch-to-nnef could not export the model: {exc}") from exc
    ctx.check_abort()
    tests = stage / "tests"
    tests.mkdir()
    example_in: dict[str, Any] = {n: a.numpy() for n, a in zip(names, args, strict=True)}
    example_out: dict[str, Any] = dict(zip(wrapper.output_names, expected, strict=True))
    np.savez(tests / "export_inputs.npz", **example_in)
    np.savez(tests / "export_outputs.npz", **example_out)
    _collect(stage / ARCHIVE_NAME, tests, out_dir)
    io = _io_spec(out_dir, "encoder", dynamic_axes, spec)
    if not spec.verify:
        return io, None

    def run(archive: Path, atol: float, rtol: float, work: Path) -> ParityReport:
        return verify_encoder(
            archive, example_in, expected, atol, rtol, work=work, check_abort=ctx.check_abort
        )

    return io, _verify_archive(spec, built, out_dir, stage, ctx, 1, run)


def _verify_archive(
    spec: NNEFSpec,
    built: OffloadedModel,
    out_dir: Path,
    stage: Path,
    ctx: JobContext,
    steps: int,
    run: Callable[[Path, float, float, Path], ParityReport],
    block_bytes: int | None = None,
) -> ParityReport:
    """The VERIFY phase both export paths end in: refuse an archive tract cannot hold even
    block by block, then ``run`` the path's own comparison within the tolerance of the
    exported dtype."""
    from service.exporters.nnef.verify import ensure_tract_fits

    ctx.set_phase(Phase.VERIFY, total=steps, unit="steps")
    archive = out_dir / ARCHIVE_NAME
    ensure_tract_fits(archive.stat().st_size, ctx.settings.tract_max_memory, block_bytes)
    from service.verification.parity import tolerance_for

    # a compressed archive is compared with PyTorch's run of its own (compressed) weights, so
    # with the float runtime's tolerance (service.exporters.nnef.exact)
    tolerance = tolerance_for("runtime", built.dtype)
    tolerance = tolerance.overridden(spec.atol, spec.rtol)
    report = run(archive, tolerance.atol, tolerance.rtol, stage / VERIFY_DIR)
    ctx.advance(steps)
    return report


def _with_logits(
    report: ParityReport,
    spec: NNEFSpec,
    built: OffloadedModel,
    io: IOSpec,
    independent: Any,
    out_dir: Path,
    work: Path,
    ctx: JobContext,
    blocks: Path | None = None,
) -> ParityReport:
    """``report`` with tract's figures on the fixed text against the job's independent
    reference (``verify.check_logits``, whole or from ``blocks``; VerificationFailed beyond
    the dtype's bounds, or beyond q4_0's for a q4_0 archive)."""
    from service.exporters.nnef.verify import check_logits

    figures = check_logits(
        out_dir / ARCHIVE_NAME, io, str(built.dtype).removeprefix("torch."), spec.compression,
        independent, work=work / "logits", check_abort=ctx.check_abort, blocks=blocks,
    )  # fmt: skip
    return replace(report, extra={**report.extra, "logits": figures})


def _collect(archive: Path, tests: Path, out_dir: Path) -> None:
    if not archive.is_file():
        raise ExportFailed("torch-to-nnef finished without writing the archive")
    shutil.move(archive, out_dir / ARCHIVE_NAME)
    shutil.move(tests / "export_inputs.npz", out_dir / "example_inputs.npz")
    shutil.move(tests / "export_outputs.npz", out_dir / "example_outputs.npz")


def _io_spec(
    out_dir: Path, kind: str, dynamic_axes: dict[str, dict[int, str]], spec: NNEFSpec
) -> IOSpec:
    import numpy as np

    from service.exporters.nnef.verify import IOSpec, TensorSpec

    def specs(path: Path) -> list[TensorSpec]:
        found = []
        with np.load(path) as bundle:
            for name in bundle.files:
                arr = bundle[name]
                axes = dynamic_axes.get(name, {})
                shape: list[int | str] = [axes.get(i, d) for i, d in enumerate(arr.shape)]
                found.append(TensorSpec(name, str(arr.dtype), shape))
        return found

    return IOSpec(
        kind=kind,
        inputs=specs(out_dir / "example_inputs.npz"),
        outputs=specs(out_dir / "example_outputs.npz"),
        tract_version=installed_tract_version(),
        compression=spec.compression,
    )


register(NNEFExporter())
