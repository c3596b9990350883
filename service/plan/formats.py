"""What one export of each format holds in memory and writes to disk, from headers alone.

One function per format; each names its formula and its terms in ``ExportPlan.notes``. The
constants were measured on this machine with the service's own jobs (forked from the job
forkserver, so a job starts with the imports it shares: ``JOB_BASE_BYTES``) on the real
corpus (SmolLM2-135M, all-MiniLM-L6) and synthetic Llama-shaped checkpoints; the figures
compared are the ones the job records (``metrics.peak_rss_bytes``, the consumers' peaks in the
manifest). ``tests/e2e/test_plan.py`` holds predictions to within 25% of those figures and
``bench/plan_accuracy.py`` prints the table.

A child's recorded peak is its own (``service.exporters.common.child_process``: not the job's
resident memory ``wait4`` folds in), so a plan's child figure is compared with it directly; the
job's resident memory beside it is ``ExportPlan.job_rss_during_children_bytes``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from service.checkpoint.headers import ITEMSIZE, CheckpointHeaders, TensorHeader
from service.checkpoint.vision import is_multimodal, is_vision_tensor
from service.plan import ChildPlan, ExportPlan, VerificationMode

MiB = 1 << 20

JOB_BASE_BYTES = 400 * MiB
"""A job process before it reads a weight: the forkserver's imports (torch, transformers,
the exporters' libraries) it shares, the checkpoint's directory, the meta build (measured:
a job that failed before its first weight, 411 MiB)."""

JOB_SHARED_BYTES = 256 * MiB
"""Of ``JOB_BASE_BYTES``, what a job process still shares with the forkserver (measured: a
process forked from one that ran ``executors.preload``, 409 MiB resident, holds 114 MiB of
private pages after a garbage collection touched every object): not the job's to pay."""

CHUNK_BYTES = 64 * MiB
"""The GGUF writer's row block of float32 (``service.exporters.gguf_stream.CHUNK_BYTES``)."""

GGUF_BASE_BYTES = 110 * MiB
"""A GGUF job beyond its base and its row blocks: llama.cpp's converter classes, the
vocabulary's metadata."""
GGUF_BLOCKS: dict[str, float] = {"f32": 3.5, "f16": 2.8, "bf16": 2.8, "q8_0": 3.6, "q4_0": 3.6}
"""Row blocks (``CHUNK_BYTES`` of float32 each) a GGUF job holds at its peak, by written type,
with the read-back on: the source block, its cast or quantized copy and their temporaries,
two output slots, the read-back's two blocks (SmolLM2: f16 691 MiB, q8_0 744 MiB)."""
GGUF_READ_BACK_BLOCKS = 1.5
"""Of those, what the read-back adds (a job with ``"verify": false`` holds that less)."""

QUANTIZER_BASE_BYTES = 32 * MiB
"""llama-quantize beyond its tensors (bench/export_gguf.py: Q + 7 L)."""

LLAMA_CHECK_BASE_BYTES = 64 * MiB
"""llama-perplexity beyond the mapped file: the context's buffers (its own peak, measured:
SmolLM2-135M q8_0, 202 MiB for a 138 MiB file). 160 MiB before a child's peak was its own,
when the job's pages at the fork were counted in it."""

MTMD_BASE_BYTES = 20 * MiB
"""llama-mtmd-cli's own peak beyond its files, KV cache and activations: 20.0-20.4 MiB on the
tiny Gemma 3, SmolVLM, Pixtral and Mistral 3 (its own ``VmHWM``, ``run_child``'s figure; 160
MiB + files before, when wait4's 430-456 MiB, the job's RSS at fork, was taken for it)."""
MTMD_VISION_WORKSPACE_BYTES = {
    "Qwen2VLForConditionalGeneration": 36 * MiB,
    "Qwen2_5_VLForConditionalGeneration": 36 * MiB,
    "Qwen3VLForConditionalGeneration": 47 * MiB,
    "Qwen3VLMoeForConditionalGeneration": 47 * MiB,
    "Glm4vForConditionalGeneration": 37 * MiB,
    "Gemma4ForConditionalGeneration": 15 * MiB,
}
"""What a family's image encoding holds beyond :data:`MTMD_BASE_BYTES`: Qwen2-VL and 2.5-VL
measured 56 MiB over their files on the tiny models and 61 MiB with a 12-block 768-wide tower
(8 text layers 1024 wide), nearly flat in the tower's width; Qwen3-VL 68.5 MiB over its files
on the tiny model; Qwen3-VL-MoE, the same tower and projector, 95.7 MiB in all with
SmolLM2's vocabulary (:data:`MTMD_VOCAB_TOKEN_BYTES`); GLM-4.1V 84.6 MiB in all on the tiny
model with SmolLM2's vocabulary, 37 MiB over the rest of the plan; Gemma 4 37.8 MiB in all
on the tiny model (a 2-head tower over the 33 x 33 patches of its fixed image), 15 MiB over the
rest; the other families nothing measurable."""
MTMD_VOCAB_TOKEN_BYTES = 300
"""What llama-mtmd-cli holds per token of the text model's vocabulary (its token tables and
BPE merges, the output layer's buffers): the tiny Qwen3-VL measured 66.7 MiB over its files
with 400 tokens and 80.8 MiB with SmolLM2's 49156, same run (14.1 MiB more: 304 bytes a
token)."""
MTMD_CONTEXT = 1024
"""The context llama-mtmd-cli gets (``gguf.mtmd_check.run_mtmd``: ``-c 1024``)."""
MTMD_UBATCH = 512
"""llama.cpp's default micro-batch: the rows of the text model's activations."""

ORT_BASE_BYTES = 40 * MiB
ORT_WEIGHT_FACTOR = 1.0
"""onnxruntime's peak RSS (measured in the child) since it verifies with its weights
memory-mapped (``exporters/onnx/mapped.py``): the mapped weights' pages it touches, which the
kernel may reclaim, plus a small anonymous part (MiniLM 122 MiB for 87 MiB of weights; SmolLM2
0.59 GiB for 0.51). Before mapping it was 1.12 x weights + 64 MiB of anonymous memory."""

ONNX_BASE_BYTES = 128 * MiB
"""The ONNX job beyond its base, the largest tensor and the graph: onnx, onnxscript, the
exporter's tables (MiniLM 590 MiB, SmolLM2 888 MiB)."""
ONNX_PER_LAYER_BYTES = int(4.5 * MiB)
"""The captured graph, per decoder layer (README)."""

TRACT_BASE_BYTES = 64 * MiB
TRACT_WEIGHT_FACTOR = 1.35
"""tract holds the whole archive in RAM (bench/export_nnef.py: 6.36 GiB for 4.70 GiB)."""

TRACT_LAYERWISE_FACTOR = 2.0
"""tract checking the archive block by block holds one block at a time (a decoder layer, or a
chunk of the embedding's or the head's rows): 64 MiB + 2 x the largest block's weights (SmolLM2 float16: a layer of 6.8 MiB peaks at 61 MiB, the head's 54 MiB at
163 MiB; tract packs a matrix for its matmul beside the loaded one)."""

NNEF_DURING_TRACT_BYTES = 64 * MiB
"""The NNEF job beyond its base while tract checks the archive (see ``plan_nnef``)."""

NNEF_PER_LAYER_BYTES = int(14.5 * MiB)
"""torch-to-nnef's trace of the meta copy, per layer (MiniLM 570 MiB for 6 layers,
SmolLM2 1043 MiB for 30, with twice the largest float32 tensor)."""

REFERENCE_WHOLE_FACTOR = 1.4
"""The independent reference whole (float32 weights within ``max_memory``): B + 1.4 x float32
weights, measured on a quiet machine at 394-439 MiB for MiniLM's 86 MiB and 1112-1115 MiB for
SmolLM2's 513 (the job phase's peak; B = 400 MiB is a bound, the phases before it measure
317-341 MiB)."""
REFERENCE_BASE_BYTES = 64 * MiB
REFERENCE_WEIGHT_FACTOR = 1.7
"""Every verified job whose model builds computes the independent reference
(``service.verification.independent``): transformers' model of the source, run on the fixed input
and the fixed text (its logits kept per chunk). Whole, in float32: SmolLM2 q8_0 and Q4_K_M jobs
peak at 1278 and 1241 MiB for 513 MiB of float32 weights. Layer by layer, the same factor over
what it holds (one layer, what stays resident) plus the logits: 655 MiB measured (base 391) on
the 2.76 GB test checkpoint, one layer of 108 MiB, a 49152-token vocabulary."""
REFERENCE_LOGITS_COPIES = 3
"""float32 ``(n_ctx, vocab)`` logits a layer-by-layer reference holds at once: the head's
output, its numpy copy and the kept window."""
REFERENCE_CTX = 128
"""Tokens per chunk of the fixed text (``verification.independent.FIXED_TEXT_CTX``)."""
REFERENCE_MAPPED_DTYPES = frozenset({"F32", "F16", "BF16"})
"""An embedding or head stored in one of these is read from the file layer by layer, never
loaded (``verification.independent.MAPPED_DTYPES``)."""

SAFETENSORS_SLOTS = 4
"""The safetensors writer's ring of read buffers (``PREFETCH_DEPTH + 2``), each
``SAFETENSORS_CHUNK_BYTES``, and as many cast buffers when it casts."""
SAFETENSORS_CHUNK_BYTES = 32 * MiB
SAFETENSORS_WRITE_EXTRA_BYTES = 64 * MiB
"""The writer beyond its buffers: the shard plan, hashing, the prefetch thread (2.76 GB
float32 -> bf16 unverified: 727 MiB measured, 720 predicted)."""

SAFETENSORS_VERIFY_FACTOR = 1.2
"""A verified safetensors export runs the export through transformers in float32, the weights
resident within ``max_memory``. The source's outputs were computed before the exports and its
resident weights released (``jobs.pipeline._release_resident_weights``), so only the export's
model is held (MiniLM 440 MiB for 86 MiB of float32 weights, SmolLM2 992 MiB for 513; it was
2.1 while the source's weights stayed resident through the job)."""

GGUF_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
    "q2_k": 2.63 / 8, "q3_k_s": 3.5 / 8, "q3_k_m": 3.91 / 8, "q3_k_l": 4.27 / 8,
    "q4_k_s": 4.58 / 8, "q4_k_m": 4.89 / 8, "q5_k_s": 5.54 / 8, "q5_k_m": 5.69 / 8,
    "q6_k": 6.56 / 8, "iq4_nl": 4.5 / 8, "iq4_xs": 4.25 / 8,
}  # fmt: skip
"""Bytes per weight of a matrix stored in each GGUF type (llama-quantize's averages for the
K-quant mixtures); vectors (norms, biases) stay float32."""

UNQUANTIZED_GGUF = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0"})


def _layers(headers: CheckpointHeaders) -> int:
    config = headers.config or {}
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _largest_bytes(headers: CheckpointHeaders, itemsize: float | None = None) -> int:
    """Bytes of the largest tensor, stored (``itemsize`` None) or as ``itemsize`` per element."""
    largest = headers.largest()
    if largest is not None:
        return int(largest.numel * (itemsize or ITEMSIZE[largest.dtype]))
    config = headers.config or {}  # a pickle: the largest of what the config describes
    hidden = int(config.get("hidden_size") or 0)
    rows = max(int(config.get("vocab_size") or 0), int(config.get("intermediate_size") or 0))
    estimate = int(rows * hidden * (itemsize or 4))
    if headers.weight_bytes:
        # ... but no tensor is larger than the files holding it (stored in 16 bits at least): a
        # config the weights contradict is the job's config_mismatch, not a plan of terabytes.
        stored = headers.weight_bytes
        estimate = min(estimate, stored if itemsize is None else int(stored // 2 * itemsize))
    return estimate


def _floating_elements(headers: CheckpointHeaders) -> int:
    if headers.tensors:
        return sum(t.numel for t in headers.tensors if t.floating)
    return headers.weight_bytes // 2  # a pickle: assume 16-bit weights


def _export_dtype_bytes(headers: CheckpointHeaders, asked: str | None) -> int:
    """Bytes per weight of an ONNX or NNEF export: the asked dtype, else float16 stays
    float16 and everything else becomes float32 (``export_dtype``)."""
    if asked is not None:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[asked]
    return 2 if headers.source_dtype == "F16" else 4


def _causal_lm_with_tokenizer(headers: CheckpointHeaders) -> bool:
    """Whether the job computes the independent reference for a verified GGUF: a causal LM
    whose tokenizer can tokenize the fixed text."""
    names = (headers.config or {}).get("architectures") or []
    causal = any(str(n).endswith(("ForCausalLM", "LMHeadModel")) for n in names)
    return causal and any(f in headers.files for f in ("tokenizer.json", "tokenizer.model"))


def _ties(headers: CheckpointHeaders) -> int:
    """Bytes of an output head the config ties to the input embedding, when both are stored."""
    if not (headers.config or {}).get("tie_word_embeddings"):
        return 0
    names = {t.name: t for t in headers.tensors}
    head = names.get("lm_head.weight")
    return head.nbytes if head is not None and len(names) > 1 else 0


# --- safetensors ------------------------------------------------------------------------------


def _ring_bytes(headers: CheckpointHeaders) -> int:
    """What the writer's ring of read buffers holds at most: a slot's pages are touched only as
    far as the largest piece read into it, so the ring is bounded by the ``SAFETENSORS_SLOTS``
    largest pieces (a tensor cut in pieces of at most ``SAFETENSORS_CHUNK_BYTES``), not by
    slots x chunk (MiniLM, whose largest tensor is 45 MiB, touched ~50 MiB of the 128)."""
    if not headers.tensors:
        return SAFETENSORS_SLOTS * SAFETENSORS_CHUNK_BYTES
    pieces: list[int] = []
    for t in headers.tensors:
        full, rest = divmod(t.nbytes, SAFETENSORS_CHUNK_BYTES)
        pieces += [SAFETENSORS_CHUNK_BYTES] * min(full, SAFETENSORS_SLOTS) + (
            [rest] if rest else []
        )
    return sum(sorted(pieces, reverse=True)[:SAFETENSORS_SLOTS])


def plan_safetensors(
    spec: Any, headers: CheckpointHeaders, max_memory: int, verify: bool
) -> ExportPlan:
    """Shards written tensor by tensor (a cast block at a time); verified by running the source
    and the export in transformers with the weights resident within ``max_memory``."""
    out_itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(spec.dtype), None)
    artifact = 0
    for t in headers.tensors:
        size = ITEMSIZE[t.dtype] if out_itemsize is None or not t.floating else out_itemsize
        artifact += t.numel * size
    artifact = (artifact or headers.weight_bytes) - _ties(headers)
    casts = out_itemsize is not None and any(
        t.floating and ITEMSIZE[t.dtype] != out_itemsize for t in headers.tensors
    )
    ring = _ring_bytes(headers)
    buffers = ring * (2 if casts else 1)
    writing = JOB_BASE_BYTES + buffers + SAFETENSORS_WRITE_EXTRA_BYTES
    notes = [
        (
            f"writing: base {JOB_BASE_BYTES >> 20} MiB + {SAFETENSORS_SLOTS} read buffers"
            f"{' and as many cast buffers' if casts else ''} (the {SAFETENSORS_SLOTS} largest "
            f"pieces of at most {SAFETENSORS_CHUNK_BYTES >> 20} MiB: {ring >> 20} MiB) + "
            f"{SAFETENSORS_WRITE_EXTRA_BYTES >> 20} MiB"
        )
    ]
    verification: VerificationMode = "none"
    peak = writing
    if verify and headers.config is not None:
        resident = min(max_memory, _floating_elements(headers) * 4)
        peak = max(writing, JOB_BASE_BYTES + int(SAFETENSORS_VERIFY_FACTOR * resident))
        verification = "reference"
        notes.append(
            f"verifying: base + {SAFETENSORS_VERIFY_FACTOR} x float32 weights resident within "
            f"max_memory ({resident >> 20} MiB)"
        )
        reference, note = _reference_bytes(headers, max_memory)
        peak = max(peak, reference)
        notes.append(note)
    return ExportPlan(
        format="safetensors", job_peak_rss_bytes=peak, job_rss_during_children_bytes=peak,
        verification=verification, artifact_bytes=artifact, notes=tuple(notes),
    )  # fmt: skip


# --- GGUF -------------------------------------------------------------------------------------


def _gguf_matrix(t: TensorHeader) -> bool:
    return t.floating and len(t.shape) >= 2


def _gguf_bytes(headers: CheckpointHeaders, type_name: str) -> int:
    """The GGUF file's size: matrices in the type, vectors in float32, the vocabulary."""
    per = GGUF_TYPE_BYTES.get(type_name.lower(), 2.0)
    total = 0
    for t in headers.tensors:
        total += int(t.numel * (per if _gguf_matrix(t) else 4))
    if not headers.tensors:
        total = int(headers.weight_bytes / 2 * per)
    total -= int(_ties(headers) / 4 * per) if _ties(headers) else 0
    vocab = int((headers.config or {}).get("vocab_size") or 0)
    return total + vocab * 24  # tokens, scores, types and merges


def _transformed(headers: CheckpointHeaders) -> int:
    """Float32 bytes of the largest tensor llama.cpp's converter evaluates whole: a q/k
    projection it permutes (Llama-family classes); a MoE layer's experts stream one after the
    other and are not counted."""
    permuted = [t for t in headers.tensors if t.name.endswith(("q_proj.weight", "k_proj.weight"))]
    return max((t.numel * 4 for t in permuted), default=0)


VOCABULARY_MATRICES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                       "lm_head.weight")  # fmt: skip


def _read_from_file(t: TensorHeader) -> bool:
    """Whether a layer-by-layer reference reads this tensor from the file instead of loading
    it: the input embedding or output head, outside the layer stack, stored as plain floats."""
    return (
        t.name.endswith(VOCABULARY_MATRICES) and ".layers." not in t.name
        and t.dtype in REFERENCE_MAPPED_DTYPES
    )  # fmt: skip


def _reference_bytes(headers: CheckpointHeaders, max_memory: int | None) -> tuple[int, str]:
    """The job process's peak while it computes the independent reference, and its formula
    in words. Whole (float32 weights within ``max_memory``): B + 1.4 x float32 weights. Layer by layer (``verification.independent``): B + 64 MiB + 1.7 x (one layer + what
    stays resident outside the stack, the embedding and head read from the file excluded, in
    the stored dtype) + 3 x n_ctx x vocab float32 logits (a causal LM with a tokenizer); a
    pickle (no headers) is bounded by ``max_memory``."""
    weights = _floating_elements(headers) * 4
    if max_memory is None or weights <= max_memory:
        held = int(REFERENCE_WHOLE_FACTOR * weights)
        return JOB_BASE_BYTES + held, (
            f"the independent reference (transformers, float32, whole): base + "
            f"{REFERENCE_WHOLE_FACTOR} x float32 weights ({held >> 20} MiB)"
        )
    layers = _layers(headers)
    vocab = int((headers.config or {}).get("vocab_size") or 0)
    causal = _causal_lm_with_tokenizer(headers)
    logits = REFERENCE_LOGITS_COPIES * REFERENCE_CTX * vocab * 4 if causal else 0
    if not headers.tensors or not layers:
        layer, rest = max_memory, 0
    else:
        floating = [t for t in headers.tensors if t.floating]
        layer = sum(t.nbytes for t in floating if ".layers." in t.name) // layers
        rest = sum(
            t.nbytes for t in floating if ".layers." not in t.name and not _read_from_file(t)
        )
    held = int(REFERENCE_WEIGHT_FACTOR * (layer + rest))
    return JOB_BASE_BYTES + REFERENCE_BASE_BYTES + held + logits, (
        f"the independent reference (transformers, layer by layer): base + 64 MiB + "
        f"{REFERENCE_WEIGHT_FACTOR} x (one layer {layer >> 20} MiB + resident rest {rest >> 20} "
        f"MiB; embedding and head read from the file) + logits {logits >> 20} MiB"
    )


def plan_gguf(spec: Any, headers: CheckpointHeaders, max_memory: int | None = None) -> ExportPlan:
    """B + G + C x m + T: the job's base, the converter and vocabulary, ``m`` row blocks of
    ``C`` float32 bytes (by written type, less with the read-back off), and the largest tensor
    llama.cpp's converter evaluates whole (a permuted q/k projection; a MoE layer's experts
    stream one after the other and add nothing). A K-quant writes the f16 file that way, then
    llama-quantize (Q + 7 L, L the largest tensor's elements) and, verified, llama.cpp's
    perplexity and tokenizer checks, each mapping a file, run as children."""
    type_name = str(spec.type).lower()
    quantized = type_name not in UNQUANTIZED_GGUF
    written = "f16" if quantized else type_name
    largest = headers.largest()
    chunk = min(CHUNK_BYTES, largest.numel * 4) if largest is not None else CHUNK_BYTES
    blocks = GGUF_BLOCKS.get(written, 3.6) - (0 if spec.verify else GGUF_READ_BACK_BLOCKS)
    transformed = _transformed(headers)
    job = int(JOB_BASE_BYTES + GGUF_BASE_BYTES + chunk * blocks + transformed)
    notes_reference = ""
    if spec.verify and headers.config is not None:
        # transformers loads the float32 weights whole when they fit max_memory, else layer
        # by layer from disk (service.verification.independent)
        reference, notes_reference = _reference_bytes(headers, max_memory)
        job = max(job, reference)
    notes = [
        (
            f"job: B {JOB_BASE_BYTES >> 20} MiB + G {GGUF_BASE_BYTES >> 20} MiB + {blocks} x C "
            f"{chunk >> 20} MiB + T {transformed >> 20} MiB (the largest tensor the converter "
            "evaluates whole; MoE experts stream)"
        ),
        *([notes_reference] if notes_reference else []),
    ]
    artifact = _gguf_bytes(headers, type_name)
    children: list[ChildPlan] = []
    scratch = 0
    if quantized:
        f16 = _gguf_bytes(headers, "f16")
        scratch = f16
        elements = largest.numel if largest is not None else f16 // 2
        # of its 7 bytes per element, the f16 input's 2 are the mapped file
        children.append(
            ChildPlan("llama-quantize", QUANTIZER_BASE_BYTES + 7 * elements, 2 * elements)
        )
        if spec.verify:
            children.append(ChildPlan("llama-perplexity", LLAMA_CHECK_BASE_BYTES + f16, f16))
        notes.append(
            f"llama-quantize: Q {QUANTIZER_BASE_BYTES >> 20} MiB + 7 x L ({elements} elements "
            f"of the largest tensor); llama-perplexity maps the f16 file ({f16 >> 20} MiB)"
        )
    elif spec.verify and _causal_lm_with_tokenizer(headers):
        # the logits check against the reference: llama.cpp maps the GGUF file itself
        children.append(ChildPlan("llama-perplexity", LLAMA_CHECK_BASE_BYTES + artifact, artifact))
        notes.append(f"llama-perplexity maps the file ({artifact >> 20} MiB)")
    if is_multimodal(headers.config):
        job, artifact = _plan_vlm(spec, headers, type_name, job, artifact, children, notes)
    return ExportPlan(
        format="gguf", job_peak_rss_bytes=job,
        job_rss_during_children_bytes=JOB_BASE_BYTES + GGUF_BASE_BYTES,
        children=tuple(children),
        verification="read_back" if spec.verify else "layout",
        artifact_bytes=artifact, scratch_bytes=scratch, notes=tuple(notes),
    )  # fmt: skip


def _plan_vlm(
    spec: Any,
    headers: CheckpointHeaders,
    type_name: str,
    job: int,
    artifact: int,
    children: list[ChildPlan],
    notes: list[str],
) -> tuple[int, int]:
    """A VLM's GGUF beyond its text model: the vision tensors go to the projector file
    (``mmproj-*.gguf``, f32, q8_0 for q8_0/q4_0, else f16: ``gguf.mmproj.mmproj_type``) instead
    of the text file, written by the same streaming writer (no more row blocks). Verified, the
    mtmd check (for a llama-quantize type on the f16 file it quantized) runs transformers' whole VLM in float32 in the job
    (B + 64 MiB + 1.7 x float32 weights, whatever ``max_memory``) and llama-mtmd-cli, which
    maps the text file and loads the projector (:func:`_mtmd_peak`). Returns the job's
    peak and the artifact's bytes; appends the child and the notes."""
    vision = [t for t in headers.tensors if is_vision_tensor(t.name)]
    per_text = GGUF_TYPE_BYTES.get(type_name, 2.0)
    per_projector = 4.0 if type_name == "f32" else GGUF_TYPE_BYTES["q8_0"] if type_name in (
        "q8_0", "q4_0") else 2.0  # fmt: skip
    in_text = sum(int(t.numel * (per_text if _gguf_matrix(t) else 4)) for t in vision)
    projector = sum(int(t.numel * (per_projector if _gguf_matrix(t) else 4)) for t in vision)
    text = max(0, artifact - in_text)
    notes.append(
        f"projector: {len(vision)} vision tensors, {projector >> 20} MiB, streamed like the text "
        "model's"
    )
    if not spec.verify:
        return job, text + projector
    # a llama-quantize type's check runs on the f16 file it was made from (scaled back to f16)
    mapped = text if type_name in UNQUANTIZED_GGUF else int(text * 2.0 / per_text)
    weights = _floating_elements(headers) * 4
    reference = JOB_BASE_BYTES + REFERENCE_BASE_BYTES + int(REFERENCE_WEIGHT_FACTOR * weights)
    tool = _mtmd_peak(headers.config or {}, mapped, projector)
    children.append(ChildPlan("llama-mtmd-cli", tool, mapped))
    notes.append(
        f"mtmd check: transformers' whole VLM in float32 in the job, base + 64 MiB + "
        f"{REFERENCE_WEIGHT_FACTOR} x float32 weights ({weights >> 20} MiB); llama-mtmd-cli "
        f"maps the text file ({mapped >> 20} MiB), loads the projector and holds "
        f"{(tool - mapped - projector) >> 20} MiB of its own"
    )
    return max(job, reference), text + projector


def _mtmd_peak(config: dict[str, Any], mapped: int, projector: int) -> int:
    """llama-mtmd-cli's peak RSS: :data:`MTMD_BASE_BYTES`, the family's vision workspace, what
    its vocabulary holds (:data:`MTMD_VOCAB_TOKEN_BYTES` a token), the mapped text file, the projector, the f16 KV cache of :data:`MTMD_CONTEXT` positions
    (cleared at start, so resident) and the text model's activations (8 bytes per element of
    a micro-batch of hidden and FFN rows). Measured within 7% on the tiny Gemma 3, SmolVLM,
    Qwen2-VL, Qwen2.5-VL, Pixtral and Mistral 3 and on a Gemma 3 and a Qwen2-VL of ~250 MB
    (``tests/integration/exporters/gguf/test_vlm.py`` compares)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def num(key: str, default: int) -> int:
        value = (text or {}).get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    hidden = num("hidden_size", 0)
    heads = max(1, num("num_attention_heads", 1))
    head_dim = num("head_dim", hidden // heads)
    kv = 2 * num("num_hidden_layers", 0) * MTMD_CONTEXT * num("num_key_value_heads", heads)
    activations = 8 * MTMD_UBATCH * (hidden + num("intermediate_size", 4 * hidden))
    arch = str((config.get("architectures") or [""])[0])
    workspace = MTMD_VISION_WORKSPACE_BYTES.get(arch, 0)
    vocab = MTMD_VOCAB_TOKEN_BYTES * num("vocab_size", 0)
    return (
        MTMD_BASE_BYTES + workspace + vocab + mapped + projector + kv * head_dim * 2 + activations
    )


# --- ONNX -------------------------------------------------------------------------------------


def plan_onnx(spec: Any, headers: CheckpointHeaders) -> ExportPlan:
    """The job's base + 128 MiB + the largest tensor (twice when cast) + 4.5 MiB per layer;
    onnxruntime maps every weight: 40 MiB + the weights' pages."""
    itemsize = _export_dtype_bytes(headers, spec.dtype)
    largest = _largest_bytes(headers, itemsize)
    cast = headers.source_dtype not in (None, {4: "F32", 2: "F16"}[itemsize])
    layers = _layers(headers)
    job = (
        JOB_BASE_BYTES
        + ONNX_BASE_BYTES
        + largest * (2 if cast else 1)
        + layers * ONNX_PER_LAYER_BYTES
    )
    weights = _floating_elements(headers) * itemsize - _ties(headers) // 4 * itemsize
    children = (
        (
            ChildPlan(
                "onnxruntime",
                ORT_BASE_BYTES + int(ORT_WEIGHT_FACTOR * weights),
                int(ORT_WEIGHT_FACTOR * weights),
            ),
        )
        if spec.verify
        else ()
    )
    return ExportPlan(
        format="onnx", job_peak_rss_bytes=job, job_rss_during_children_bytes=job,
        children=children, verification="whole" if spec.verify else "none",
        artifact_bytes=weights, offload_bytes=0,
        notes=((f"job: base + largest tensor {largest >> 20} MiB{' x 2 (cast)' if cast else ''} "
               f"+ {layers} layers x 4.5 MiB; onnxruntime: 40 MiB + mapped weights "
               f"({weights >> 20} MiB)"),),
    )  # fmt: skip


# --- NNEF -------------------------------------------------------------------------------------


def block_weight_bytes(tensors: Iterable[tuple[str, int]]) -> int:
    """The largest block's weight bytes when tract checks a causal LM block by block, from its
    tensors' names and sizes: a decoder layer is every tensor under one ``layers.N.`` (or
    ``h.N.``, ``layer.N.``, ``blocks.N.``) prefix; the embedding lookup and the output head
    are blocks of their own, run in chunks of their rows no larger than the largest layer (at
    least 16 MiB: ``service.exporters.nnef.layerwise``), so the largest block is the largest
    layer, or the largest tensor outside the layers up to that chunk."""
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
    return max(layer, min(outside, max(layer, MIN_VOCAB_CHUNK_BYTES)))


MIN_VOCAB_CHUNK_BYTES = 16 * MiB
"""``service.exporters.nnef.layerwise.MIN_VOCAB_CHUNK_BYTES`` (a format module the plan does
not import: ``tests/unit/plan/test_plan_tract_layerwise.py`` holds the two equal)."""


_LAYER_PREFIX = re.compile(r"\.(?:layers|h|layer|blocks)\.(\d+)\.")


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


def plan_nnef(spec: Any, headers: CheckpointHeaders, tract_limit: int | None = None) -> ExportPlan:
    """The job traces a meta copy (about 14.5 MiB per layer) and streams each weight from the
    offload store (twice the largest, in float32); tract holds the whole archive
    (64 MiB + 1.35 x archive) when it verifies it, or, when that exceeds ``tract_limit``
    (``MODELPREP_TRACT_MAX_MEMORY``) and the model is a causal LM, one block at a time
    (64 MiB + 2 x the largest block)."""
    itemsize = _export_dtype_bytes(headers, None)
    weights = _floating_elements(headers) * itemsize - _ties(headers) // 4 * itemsize
    compressed = getattr(spec, "compression", None) == "q4_0"
    archive = int(weights * (18 / 32 / itemsize)) if compressed else weights
    largest = _largest_bytes(headers, 4)
    layers = _layers(headers)
    job = JOB_BASE_BYTES + 2 * largest + layers * NNEF_PER_LAYER_BYTES
    verify = bool(spec.verify) and not compressed
    block = (
        block_weight_bytes((t.name, t.numel * itemsize) for t in headers.tensors if t.floating)
        if _causal(headers) and headers.tensors
        else None
    )
    mode = tract_mode(archive, block, tract_limit) if verify else None
    whole, layerwise = tract_peaks(archive, block or 0)
    if not verify:
        children: tuple[ChildPlan, ...] = ()
        tract = ""
    elif mode == "layerwise":
        children = (ChildPlan("tract", layerwise),)
        tract = (
            f"tract block by block: 64 MiB + 2 x largest block ({(block or 0) >> 20} MiB), "
            f"whole would be 64 MiB + 1.35 x archive ({archive >> 20} MiB)"
        )
    else:  # whole, or None: the whole figure, which the budget then refuses
        children = (ChildPlan("tract", whole),)
        tract = f"tract: 64 MiB + 1.35 x archive ({archive >> 20} MiB)"
    return ExportPlan(
        # the trace is gone and the heap trimmed before tract runs (service.memory.heap): the job
        # holds its base and little else, whatever the largest tensor (its resident memory
        # sampled while tract ran: MiniLM 455 MiB; a float32 Llama of hidden 4096 and a
        # 49152-token vocabulary, 0.75 GiB tensors, 470 MiB, where base + 2 x largest said 1936)
        format="nnef", job_peak_rss_bytes=job,
        job_rss_during_children_bytes=JOB_BASE_BYTES + NNEF_DURING_TRACT_BYTES,
        children=children, verification=(mode or "whole") if verify else "none",
        artifact_bytes=archive,
        notes=(
            (f"job: base + 2 x largest tensor ({largest >> 20} MiB float32) + {layers} layers x "
            f"14.5 MiB; {tract}"),
        ),
    )  # fmt: skip


def plan_export(
    spec: Any,
    headers: CheckpointHeaders,
    max_memory: int,
    verify: bool = True,
    tract_limit: int | None = None,
) -> ExportPlan:
    """The plan of one export spec (its ``format`` picks the formula); ``verify`` False (the
    job's ``"verify": false``) turns every export's verification off; ``tract_limit`` is what
    tract may hold (``MODELPREP_TRACT_MAX_MEMORY``), which picks how an NNEF archive is checked."""
    if not verify and getattr(spec, "verify", False):
        spec = spec.model_copy(update={"verify": False})
    plan: ExportPlan
    if spec.format == "safetensors":
        plan = plan_safetensors(spec, headers, max_memory, verify)
    elif spec.format == "gguf":
        plan = plan_gguf(spec, headers, max_memory)
    else:
        plan = (
            plan_nnef(spec, headers, tract_limit) if spec.format == "nnef"
            else plan_onnx(spec, headers)
        )  # fmt: skip
        if verify and headers.config is not None:
            # the job's model is checked against the independent reference first
            reference, note = _reference_bytes(headers, max_memory)
            plan = replace(
                plan, job_peak_rss_bytes=max(plan.job_peak_rss_bytes, reference),
                notes=(*plan.notes, note),
            )  # fmt: skip
    return replace(plan, job_shared_bytes=JOB_SHARED_BYTES)
