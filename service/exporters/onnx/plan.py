"""What an ONNX export holds in memory and writes to disk, from the checkpoint's headers.

The terms every format shares (the job's base, the independent reference) are
:mod:`service.plan.terms`; :meth:`ONNXExporter.plan` hands this formula to the service.

int4/int8 weights (``MatMulNBits``) add terms that do not grow with any tensor: each weight is
quantized a slice of rows at a time (:data:`QUANTIZE_SLICE_BYTES`), its scales and zero points
spooled to a file in the work directory until they are written (``scratch_bytes``); the
artifact, and what onnxruntime maps, is the quantized size (:func:`nbits_weight_bytes`). The
exact check multiplies each quantized layer by its weight dequantized from the artifact a block
of rows at a time, in float32 (:data:`DEQUANTIZED_ITEMSIZE`).

No job term is a whole tensor (issue 34): the external data is written, and PyTorch's side of
the check multiplies, a block of at most :data:`WRITE_BLOCK_BYTES` at a time
(:mod:`service.exporters.onnx.blocks`), in the wider of the stored and exported dtypes. The job
holds the block as read and, when it casts, the block cast beside it (:data:`WRITE_BLOCK_COPIES`);
a quantized weight is dequantized for the check a block of float32 rows at a time. So the job's
term is ``min(WRITE_BLOCK_BYTES, largest tensor in the wider dtype) x copies``: flat once the
largest tensor passes the block (at Llama-3-70B widths 128 MiB cast, where the whole embedding
was 4008 MiB x 2).
"""

from __future__ import annotations

from typing import Any

from service.checkpoint.headers import CheckpointHeaders, TensorHeader
from service.exporters.common.families import is_causal_lm
from service.exporters.onnx.quantize import GATHERED_BITS, NBits, quantized_bytes
from service.plan import ChildPlan, ExportPlan, PlanInputs
from service.plan.terms import (
    JOB_BASE_BYTES,
    REFERENCE_CTX,
    MiB,
    causal_lm_with_tokenizer,
    export_dtype_bytes,
    floating_elements,
    largest_bytes,
    layer_count,
    tied_head_bytes,
    with_independent_reference,
)

ORT_BASE_BYTES = 40 * MiB
ORT_WEIGHT_FACTOR = 1.0
"""onnxruntime's peak RSS (measured in the child) since it verifies with its weights
memory-mapped (``exporters/onnx/mapped.py``): the mapped weights' pages it touches, which the
kernel may reclaim, plus a small anonymous part (MiniLM 122 MiB for 87 MiB of weights; SmolLM2
0.59 GiB for 0.51). Before mapping it was 1.12 x weights + 64 MiB of anonymous memory.

onnxruntime 1.31.1 on CPU uses aligned external data in place (default session options; no
``session.use_mmap``-like option is needed, and ``add_external_initializers`` would hand it
copies): the child's ``VmHWM`` against its sampled ``RssAnon`` peak, on bfloat16 Llamas exported
to float32 (the decode command): 364 MiB of weights, RSS 313 MiB, anonymous 26 MiB; 1456 MiB of
weights (4x), RSS 1037 MiB, anonymous 28 MiB. The mapped pages are the child's
``ChildPlan.mapped_bytes`` (reclaimable, not held against the budget); the anonymous part is
:data:`ORT_BASE_BYTES` plus, for the logits check, :data:`ORT_LOGITS_COPIES`."""
ORT_LOGITS_COPIES = 6
"""The logits check's command (``ort_cli`` ``logits``: two chunks of ``REFERENCE_CTX`` tokens)
holds float32 ``(n_ctx, vocab)`` logits this many times in anonymous memory (the graph's output,
its copy, the kept windows): measured 104 MiB anonymous at vocabulary 32000 and 188 MiB at
64000, 5.4 copies over a 20 MiB base. At 128256 (Llama 3) that is 375 MiB."""

ONNX_BASE_BYTES = 128 * MiB
"""The ONNX job beyond its base, the largest tensor and the graph: onnx, onnxscript, the
exporter's tables (MiniLM 590 MiB, SmolLM2 888 MiB)."""
ONNX_PER_LAYER_BYTES = int(4.5 * MiB)
"""The captured graph, per decoder layer (README)."""

QUANTIZE_SLICE_BYTES = 3 * 64 * MiB
"""int4/int8: one slice of a weight's rows being quantized, whatever the weight's size: at most
64 MiB of float32 rows read from the offload store (``quantize.NBitsWeight``), the transposed
copy onnxruntime's kernel quantizes, the source-dtype read they were cast from, and the slice's
packed blocks and scales (an eighth to a quarter of it)."""

DEQUANTIZED_ITEMSIZE = 4
"""int4/int8 with the check: a block of a quantized weight's rows (:data:`WRITE_BLOCK_BYTES` of
float32), dequantized from the artifact for PyTorch's run (``artifact_weights``), plus its
cast when the export is float16, and on the weight's first run the source's rows it is
compared with (read and, when the export casts, cast: at most 4 bytes each per element)."""

WRITE_BLOCK_BYTES = 64 * MiB
"""A weight's block, written or multiplied (``blocks.WRITE_BLOCK_BYTES``: one figure)."""
WRITE_BLOCK_COPIES = 2
"""Blocks the job holds at once when it casts: the block read in the stored dtype and its cast
(one when the export keeps the stored dtype: the read is written as it is)."""

EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
"""Input embeddings: read by ``Gather``, never by a ``MatMul``: float, unless tied to a
quantized head (:func:`nbits_weight_bytes`)."""


def _quantized(t: TensorHeader) -> bool:
    """Whether the export writes this tensor as ``MatMulNBits`` blocks: a floating 2-D weight
    other than an embedding (every linear layer, the output head included)."""
    return t.floating and len(t.shape) == 2 and not t.name.endswith(EMBEDDINGS)


def nbits_weight_bytes(headers: CheckpointHeaders, scheme: NBits, itemsize: int) -> int:
    """Bytes of an int4/int8 export's weights: each linear weight ``[n, k]`` quantized
    (:func:`~service.exporters.onnx.quantize.quantized_bytes`, scales in the export's dtype),
    every other floating tensor in ``itemsize``. A head tied to the embedding is one quantized
    weight: at the widths the embedding reads it too (:data:`~service.exporters.onnx.quantize.
    GATHERED_BITS`, ``GatherBlockQuantized``) the float embedding is not written, at the others
    it is written beside the head's quantized copy (a tied head the checkpoint also stores is
    that copy: counted once, quantized)."""
    total = 0
    for t in headers.tensors:
        if not t.floating:
            continue
        if _quantized(t):
            total += quantized_bytes(scheme, t.shape[0], t.shape[1], itemsize)
        else:
            total += t.numel * itemsize
    config = headers.config or {}
    names = {t.name for t in headers.tensors}
    if config.get("tie_word_embeddings"):
        embedding = headers.largest(lambda t: t.name.endswith(EMBEDDINGS) and len(t.shape) == 2)
        if embedding is not None:
            if "lm_head.weight" not in names:
                total += quantized_bytes(scheme, embedding.shape[0], embedding.shape[1], itemsize)
            if scheme.bits in GATHERED_BITS:
                total -= embedding.numel * itemsize
    return total


def _spool_bytes(headers: CheckpointHeaders, scheme: NBits, itemsize: int) -> int:
    """The largest weight's scales and zero points, spooled while its blocks are written."""
    largest = headers.largest(_quantized)
    if largest is None:
        return 0
    n, k = largest.shape
    return quantized_bytes(scheme, n, k, itemsize) - quantized_bytes(
        NBits(scheme.bits, scheme.block_size, True), n, k, 0
    )


def write_block_bytes(
    headers: CheckpointHeaders, itemsize: int, cast: bool
) -> tuple[int, list[str]]:
    """The job's weight term and its words: a block of at most :data:`WRITE_BLOCK_BYTES` (the
    largest tensor when it is smaller) in the wider of the stored and exported dtypes, twice when
    the export casts (the read and its cast, :data:`WRITE_BLOCK_COPIES`). Flat in the width."""
    stored = largest_bytes(headers)
    wider = max(largest_bytes(headers, itemsize), stored)
    block = min(WRITE_BLOCK_BYTES, wider)
    copies = WRITE_BLOCK_COPIES if cast else 1
    words = (
        f"a block of the largest tensor {block >> 20} MiB x {copies}"
        f"{' (read and cast)' if cast else ''} (largest tensor {wider >> 20} MiB; blocks of "
        f"{WRITE_BLOCK_BYTES >> 20} MiB)"
    )
    return block * copies, [words]


def plan_onnx(spec: Any, inputs: PlanInputs) -> ExportPlan:
    """The job's base + 128 MiB + a block of the largest tensor (``min(64 MiB, largest) x 2``
    when cast, x 1 when not: :func:`write_block_bytes`) + 4.5 MiB per layer;
    onnxruntime maps every weight: 40 MiB of its own (+ 6 x 128 x vocab float32 logits when
    the job checks them) + the weights' pages, mapped and reclaimable, and onnxruntime-genai's
    generator (the genai layout) 40 MiB + the same pages after it. int4/int8 add a slice of rows being
    quantized, a block of the largest quantized weight dequantized in float32 by the check, and
    the quantized sizes. The job checks its model against the independent reference first
    (:func:`with_independent_reference`)."""
    headers = inputs.headers
    itemsize = export_dtype_bytes(headers, spec.dtype)
    cast = headers.source_dtype not in (None, {4: "F32", 2: "F16"}[itemsize])
    block, terms = write_block_bytes(headers, itemsize, cast)
    layers = layer_count(headers)
    scheme: NBits | None = spec.nbits() if hasattr(spec, "nbits") else None
    extra = 0
    scratch = 0
    if scheme is None:
        weights = floating_elements(headers) * itemsize - tied_head_bytes(headers) // 4 * itemsize
    else:
        weights = nbits_weight_bytes(headers, scheme, itemsize)
        quantized = headers.largest(_quantized)
        if spec.verify and quantized is not None:
            per = DEQUANTIZED_ITEMSIZE + (itemsize if itemsize != DEQUANTIZED_ITEMSIZE else 0)
            per += itemsize + (4 if cast else 0)  # the source's rows it is compared with
            dequantized = min(WRITE_BLOCK_BYTES, quantized.numel * DEQUANTIZED_ITEMSIZE)
            dequantized = dequantized // DEQUANTIZED_ITEMSIZE * per
            if dequantized > block:
                block = dequantized
                terms = [f"a block of a quantized weight dequantized {dequantized >> 20} MiB"]
        extra = QUANTIZE_SLICE_BYTES
        scratch = _spool_bytes(headers, scheme, itemsize)
        terms.append(
            f"int{scheme.bits} block {scheme.block_size}: a slice of rows quantized "
            f"{QUANTIZE_SLICE_BYTES >> 20} MiB, scales spooled {scratch >> 20} MiB on disk"
        )
    job = JOB_BASE_BYTES + ONNX_BASE_BYTES + block + extra + layers * ONNX_PER_LAYER_BYTES
    mapped = int(ORT_WEIGHT_FACTOR * weights)
    vocab = int((headers.config or {}).get("vocab_size") or 0)
    logits = 0
    if spec.verify and inputs.verify and causal_lm_with_tokenizer(headers):
        logits = ORT_LOGITS_COPIES * REFERENCE_CTX * vocab * 4
    anonymous = ORT_BASE_BYTES + logits
    children: tuple[ChildPlan, ...] = ()
    consumers = "onnxruntime"
    if spec.verify:
        children = (ChildPlan("onnxruntime", anonymous + mapped, mapped),)
        if _genai(spec, headers):
            children += (ChildPlan("onnxruntime-genai", ORT_BASE_BYTES + mapped, mapped),)
            consumers = "onnxruntime, then onnxruntime-genai,"
    plan = ExportPlan(
        format="onnx", job_peak_rss_bytes=job, job_rss_during_children_bytes=job,
        children=children, verification="whole" if spec.verify else "none",
        artifact_bytes=weights, scratch_bytes=scratch, offload_bytes=0,
        notes=((f"job: base + {' + '.join(terms)} + {layers} layers x 4.5 MiB; {consumers} "
                f"40 MiB + mapped weights ({weights >> 20} MiB, reclaimable)"
                + (f"; onnxruntime's logits check {ORT_LOGITS_COPIES} x {REFERENCE_CTX} x vocab "
                   f"{vocab} float32 ({logits >> 20} MiB anonymous)" if logits else "")),),
    )  # fmt: skip
    return with_independent_reference(plan, inputs)


def _genai(spec: Any, headers: CheckpointHeaders) -> bool:
    """Whether the export writes the genai layout, which the job runs in onnxruntime-genai."""
    if getattr(spec, "layout", None) == "optimum":
        return False
    return is_causal_lm(headers.config or {})
