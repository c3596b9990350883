"""What an NNEF export holds in memory and writes to disk, from the checkpoint's headers, and
how tract checks the archive (whole or block by block), which the job decides with the same
functions (:func:`tract_mode`) so that the plan's mode is the job's.

The terms every format shares (the job's base, the independent reference) are
:mod:`service.plan.terms`; :meth:`NNEFExporter.plan` hands this formula to the service.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings
from service.plan import ChildPlan, ExportPlan, PlanInputs, VerificationMode
from service.plan.terms import (
    JOB_BASE_BYTES,
    MiB,
    export_dtype_bytes,
    floating_elements,
    largest_bytes,
    layer_count,
    tied_head_bytes,
    with_independent_reference,
)
from service.units import parse_size

TRACT_BASE_BYTES = 64 * MiB
TRACT_WEIGHT_FACTOR = 1.35
"""tract holds the whole archive in RAM (bench/export_nnef.py: 6.36 GiB for 4.70 GiB)."""

TRACT_LAYERWISE_FACTOR = 2.0
"""tract checking the archive block by block holds one block at a time (a decoder layer, or
below ``MODELPREP_TRACT_BLOCK_BYTES`` its attention, its MLP or a chunk of a matrix's rows, or a
chunk of the embedding's or the head's rows): 64 MiB + 2 x the largest block's weights (SmolLM2
float16: a layer of 6.8 MiB peaks at 61 MiB, the head's 54 MiB at 163 MiB; tract packs a matrix
for its matmul beside the loaded one)."""

NNEF_DURING_TRACT_BYTES = 64 * MiB
"""The NNEF job beyond its base while tract checks the archive (see ``plan_nnef``)."""

NNEF_PER_LAYER_BYTES = int(14.5 * MiB)
"""torch-to-nnef's trace of the meta copy, per layer (MiniLM 570 MiB for 6 layers,
SmolLM2 1043 MiB for 30, with twice the largest float32 tensor)."""

Q4_0_LARGEST_COPIES = 4
"""q4_0: torch-to-nnef's ``min_max_q4_0`` quantizes each Linear weight whole, the head
included: 4 x the largest tensor in float32 (bench/nnef_wide.py: a 256 MiB float32 head,
stored in bfloat16, raised the job 1018 MiB)."""


def block_weight_bytes(tensors: Iterable[tuple[str, int]], block_bytes: int | None = None) -> int:
    """The largest block's weight bytes when tract checks a causal LM block by block, from its
    tensors' names and sizes: a decoder layer is every tensor under one ``layers.N.`` (or
    ``h.N.``, ``layer.N.``, ``blocks.N.``) prefix; the embedding lookup and the output head
    are blocks of their own, run in chunks of their rows no larger than the largest layer (at
    least 16 MiB: ``service.exporters.nnef.layerwise``), so the largest block is the largest
    layer, or the largest tensor outside the layers up to that chunk.

    With ``block_bytes`` (:func:`tract_block_limit`), no block outweighs it: a layer above it
    runs as its attention and its MLP, and any matrix above it in blocks of its rows, so the
    figure is ``min(that, block_bytes)`` whatever the width, except where one packed expert
    stack (a mixture of experts, one ``tract_moe_ffn`` op) outweighs it: that stack is not cut."""
    tensors = list(tensors)
    per_layer: dict[int, int] = {}
    outside = 0
    for name, size in tensors:
        match = _LAYER_PREFIX.search(f".{name}")
        if match:
            index = int(match.group(1))
            per_layer[index] = per_layer.get(index, 0) + size
        else:
            outside = max(outside, size)
    layer = max(per_layer.values(), default=0)
    whole_layers = max(layer, min(outside, max(layer, MIN_VOCAB_CHUNK_BYTES)))
    if block_bytes is None:
        return whole_layers
    return min(whole_layers, max(block_bytes, expert_stack_bytes(tensors) // 2))


def tract_block_limit(settings: Settings | None) -> int | None:
    """The most weight bytes one block of tract's check may hold (``MODELPREP_TRACT_BLOCK_BYTES``),
    None without settings (whole layers)."""
    return None if settings is None else parse_size(settings.tract_block_bytes)


NNEF_BLOCK_BYTES = 64 * MiB
"""``MODELPREP_NNEF_BLOCK_BYTES``'s default: the export reads a weight this many stored bytes
at a time (:mod:`service.shims.torch_to_nnef`'s ``WRITE_BLOCK_BYTES``, the same figure)."""


def nnef_block_limit(settings: Settings | None) -> int:
    """The most stored bytes of one weight the export reads at a time
    (``MODELPREP_NNEF_BLOCK_BYTES``; without settings, :data:`NNEF_BLOCK_BYTES`)."""
    return NNEF_BLOCK_BYTES if settings is None else parse_size(settings.nnef_block_bytes)


MIN_VOCAB_CHUNK_BYTES = 16 * MiB
"""The smallest chunk of a vocabulary matrix's rows that :mod:`.layerwise` cuts: below it, a
chunk's tract load costs more than the memory it saves."""


_LAYER_PREFIX = re.compile(r"\.(?:layers|h|layer|blocks)\.(\d+)\.")

_EXPERT = re.compile(r"\.experts\.\d+\.")


def expert_stack_bytes(tensors: Iterable[tuple[str, int]]) -> int:
    """The largest tensor a mixture of experts stored one tensor per expert (the Hub's
    layout: ``...experts.N.gate_proj.weight``, Mixtral's ``...experts.N.w1.weight``) becomes in
    the model: transformers 5 packs a layer's experts into one stack per projection, the gate
    and up projections into one (``gate_up_proj``), which the trace and torch-to-nnef's MoE
    extractor read whole. Twice the largest projection's stack, 0 without per-expert tensors
    (a packed checkpoint's stacks are tensors of their own)."""
    stacks: dict[str, int] = {}
    for name, size in tensors:
        if _EXPERT.search(f".{name}"):
            key = _EXPERT.sub(".experts.*.", f".{name}")
            stacks[key] = stacks.get(key, 0) + size
    return 2 * max(stacks.values(), default=0)


def tract_peaks(archive_bytes: int, block_bytes: int) -> tuple[int, int]:
    """tract's predicted peak RSS running the archive whole, and block by block."""
    whole = TRACT_BASE_BYTES + int(TRACT_WEIGHT_FACTOR * archive_bytes)
    return whole, TRACT_BASE_BYTES + int(TRACT_LAYERWISE_FACTOR * block_bytes)


def tract_mode(
    archive_bytes: int, block_bytes: int | None, limit: int | None
) -> VerificationMode | None:
    """How tract checks an archive within ``limit`` bytes: ``whole`` when it can hold every
    weight, else ``layerwise`` when it can hold the largest block (``block_bytes``; None: the
    model cannot be cut, an encoder), else None (the check does not fit at all). The plan and
    the job decide with this one function, so the plan's mode is the job's."""
    whole, layerwise = tract_peaks(archive_bytes, block_bytes or 0)
    if limit is None or whole <= limit:
        return "whole"
    if block_bytes is not None and layerwise <= limit:
        return "layerwise"
    return None


def _causal(headers: CheckpointHeaders) -> bool:
    config = headers.config or {}
    return any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or ())


def tract_limit(settings: Settings | None) -> int | None:
    """What tract may hold (``MODELPREP_TRACT_MAX_MEMORY``), None without settings (no limit)."""
    if settings is None or not settings.tract_max_memory:
        return None
    return parse_size(settings.tract_max_memory)


def weight_block_bytes(headers: CheckpointHeaders, itemsize: int, block: int) -> tuple[int, str]:
    """The job's term for the weights it reads, and its words: a block of at most ``block``
    stored bytes of the largest tensor (the export writes each ``.dat``, and its forwards
    multiply or index a larger weight, that many bytes at a time: ``CheckpointTensor`` in
    :mod:`service.shims.torch_to_nnef`), beside its cast to the archive's dtype when that is
    another (``itemsize`` per element). Flat once the largest tensor outgrows the block."""
    largest = headers.largest()
    stored_itemsize = largest.nbytes / max(1, largest.numel) if largest else 2
    read = min(block, largest_bytes(headers))
    cast = int(read * itemsize / stored_itemsize) if stored_itemsize != itemsize else 0
    words = (
        f"a block of the largest tensor {read >> 20} MiB"
        + (f" + its cast {cast >> 20} MiB" if cast else "")
        + f" (largest tensor {largest_bytes(headers, itemsize) >> 20} MiB in the archive; "
        f"blocks of {block >> 20} MiB)"
    )
    return read + cast, words


def moe_stack_bytes(headers: CheckpointHeaders) -> int:
    """The largest expert stack in float32, 0 without experts: a mixture of experts' forward
    indexes its packed stacks (transformers 5), which read whole (:func:`expert_stack_bytes`
    for per-expert checkpoints, a packed tensor's own size for the others)."""
    floating = [(t.name, t.numel * 4) for t in headers.tensors if t.floating]
    packed = (size for name, size in floating if ".experts." in f".{name}")
    return max(expert_stack_bytes(floating), max(packed, default=0))


def plan_nnef(spec: Any, inputs: PlanInputs) -> ExportPlan:
    """The job traces a meta copy (about 14.5 MiB per layer) and reads each weight from the
    offload store a block at a time (:func:`weight_block_bytes`, ``MODELPREP_NNEF_BLOCK_BYTES``),
    except a mixture of experts' stacks (twice the largest, :func:`moe_stack_bytes`) and a
    q4_0 export, which torch-to-nnef quantizes a whole weight at a time
    (:data:`Q4_0_LARGEST_COPIES`); tract holds the whole archive
    (64 MiB + 1.35 x archive) when it verifies it, or, when that exceeds :func:`tract_limit`
    and the model is a causal LM, one block at a time (64 MiB + 2 x the largest block). The
    job checks its model against the independent reference first
    (:func:`with_independent_reference`)."""
    headers = inputs.headers
    itemsize = export_dtype_bytes(headers, None)
    weights = floating_elements(headers) * itemsize - tied_head_bytes(headers) // 4 * itemsize
    compressed = getattr(spec, "compression", None) == "q4_0"
    archive = int(weights * (18 / 32 / itemsize)) if compressed else weights
    layers = layer_count(headers)
    read, words = weight_block_bytes(headers, itemsize, nnef_block_limit(inputs.settings))
    stack = moe_stack_bytes(headers)
    if compressed:
        largest = largest_bytes(headers, 4)
        read = max(read, Q4_0_LARGEST_COPIES * largest)
        words = (
            f"q4_0 quantizes whole weights: {Q4_0_LARGEST_COPIES} x largest tensor "
            f"({largest >> 20} MiB float32)"
        )
    elif 2 * stack > read:
        read = 2 * stack
        words = f"2 x the largest expert stack ({stack >> 20} MiB float32), read whole"
    job = JOB_BASE_BYTES + read + layers * NNEF_PER_LAYER_BYTES
    verify = bool(spec.verify) and not compressed
    setting = tract_block_limit(inputs.settings)
    sizes = [(t.name, t.numel * itemsize) for t in headers.tensors if t.floating]
    block = block_weight_bytes(sizes, setting) if _causal(headers) and headers.tensors else None
    layer = block_weight_bytes(sizes) if block is not None else 0
    mode = tract_mode(archive, block, tract_limit(inputs.settings)) if verify else None
    whole, layerwise = tract_peaks(archive, block or 0)
    if not verify:
        children: tuple[ChildPlan, ...] = ()
        tract = ""
    elif mode == "layerwise":
        children = (ChildPlan("tract", layerwise),)
        bound = (
            f"min(block setting {setting >> 20} MiB, largest layer {layer >> 20} MiB)"
            if setting is not None
            else f"largest layer {layer >> 20} MiB"
        )
        tract = (
            f"tract block by block: 64 MiB + 2 x largest block ({(block or 0) >> 20} MiB = "
            f"{bound}), whole would be 64 MiB + 1.35 x archive ({archive >> 20} MiB)"
        )
    else:  # whole, or None: the whole figure, which the budget then refuses
        children = (ChildPlan("tract", whole),)
        tract = f"tract: 64 MiB + 1.35 x archive ({archive >> 20} MiB)"
    plan = ExportPlan(
        # the trace is gone and the heap trimmed before tract runs (service.memory.heap): the job
        # holds its base and little else, whatever the largest tensor (its resident memory
        # sampled while tract ran: MiniLM 455 MiB; a float32 Llama of hidden 4096 and a
        # 49152-token vocabulary, 0.75 GiB tensors, 470 MiB, where base + 2 x largest said 1936)
        format="nnef", job_peak_rss_bytes=job,
        job_rss_during_children_bytes=JOB_BASE_BYTES + NNEF_DURING_TRACT_BYTES,
        children=children, verification=(mode or "whole") if verify else "none",
        artifact_bytes=archive,
        notes=(
            f"job: base + {words} + {layers} layers x 14.5 MiB; {tract}",
        ),
    )  # fmt: skip
    return with_independent_reference(plan, inputs)
