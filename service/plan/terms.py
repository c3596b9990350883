"""The terms every format's plan is made of: the job's base, the independent reference, and
what the checkpoint's headers say of its weights.

A format's own formula (its package's ``plan.py``, e.g. :mod:`service.exporters.gguf.plan`)
adds what its export holds to these. The constants were measured on this machine with the
service's own jobs (forked from the job forkserver, so a job starts with the imports it shares:
``JOB_BASE_BYTES``) on the real corpus (SmolLM2-135M, all-MiniLM-L6) and synthetic
Llama-shaped checkpoints; the figures compared are the ones the job records
(``metrics.peak_rss_bytes``, the consumers' peaks in the manifest). ``tests/e2e/test_plan.py``
holds predictions to within 25% of those figures and ``bench/plan_accuracy.py`` prints the table.

A child's recorded peak is its own (``service.exporters.common.child_process``: not the job's
resident memory ``wait4`` folds in), so a plan's child figure is compared with it directly; the
job's resident memory beside it is ``ExportPlan.job_rss_during_children_bytes``.
"""

from __future__ import annotations

from dataclasses import replace

from service.checkpoint.headers import ITEMSIZE, CheckpointHeaders, TensorHeader
from service.plan import ExportPlan, PlanInputs

MiB = 1 << 20

JOB_BASE_BYTES = 400 * MiB
"""A job process before it reads a weight: the forkserver's imports (torch, transformers,
the exporters' libraries) it shares, the checkpoint's directory, the meta build (measured:
a job that failed before its first weight, 411 MiB)."""

JOB_SHARED_BYTES = 256 * MiB
"""Of ``JOB_BASE_BYTES``, what a job process still shares with the forkserver (measured: a
process forked from one that ran ``executors.preload``, 409 MiB resident, holds 114 MiB of
private pages after a garbage collection touched every object): not the job's to pay."""

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
REFERENCE_LINEAR_BLOCK_BYTES = 64 * MiB
"""Module by module, a projection larger than this in float32 is computed a block of output
rows of this many bytes at a time from the file (``verification.mapped.LINEAR_BLOCK_BYTES``)."""
REFERENCE_MAPPED_DTYPES = frozenset({"F32", "F16", "BF16"})
"""An embedding or head stored in one of these is read from the file layer by layer, never
loaded (``verification.independent.MAPPED_DTYPES``)."""


def layer_count(headers: CheckpointHeaders) -> int:
    """The model's depth as config.json gives it (0 when it does not)."""
    config = headers.config or {}
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def largest_bytes(headers: CheckpointHeaders, itemsize: float | None = None) -> int:
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


def floating_elements(headers: CheckpointHeaders) -> int:
    """Elements of every floating tensor: what a cast or a float32 copy of the weights scales
    with."""
    if headers.tensors:
        return sum(t.numel for t in headers.tensors if t.floating)
    return headers.weight_bytes // 2  # a pickle: assume 16-bit weights


def export_dtype_bytes(headers: CheckpointHeaders, asked: str | None) -> int:
    """Bytes per weight of an ONNX or NNEF export: the asked dtype, else float16 stays
    float16 and everything else becomes float32 (``export_dtype``)."""
    if asked is not None:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[asked]
    return 2 if headers.source_dtype == "F16" else 4


def causal_lm_with_tokenizer(headers: CheckpointHeaders) -> bool:
    """Whether the job's independent reference scores the fixed text (its logits are held, and
    a verified GGUF is checked by llama.cpp on it): a causal LM whose tokenizer can tokenize it."""
    names = (headers.config or {}).get("architectures") or []
    causal = any(str(n).endswith(("ForCausalLM", "LMHeadModel")) for n in names)
    return causal and any(f in headers.files for f in ("tokenizer.json", "tokenizer.model"))


def tied_head_bytes(headers: CheckpointHeaders) -> int:
    """Bytes of an output head the config ties to the input embedding, when both are stored."""
    if not (headers.config or {}).get("tie_word_embeddings"):
        return 0
    names = {t.name: t for t in headers.tensors}
    head = names.get("lm_head.weight")
    return head.nbytes if head is not None and len(names) > 1 else 0


VOCABULARY_MATRICES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                       "lm_head.weight")  # fmt: skip
"""The vocabulary's matrices (input embedding, output head), which a layer-by-layer reference
reads from the file rather than holds."""


def _read_from_file(t: TensorHeader) -> bool:
    """Whether a layer-by-layer reference reads this tensor from the file instead of loading
    it: the input embedding or output head, outside the layer stack, stored as plain floats."""
    return (
        t.name.endswith(VOCABULARY_MATRICES) and ".layers." not in t.name
        and t.dtype in REFERENCE_MAPPED_DTYPES
    )  # fmt: skip


def reference_bytes(headers: CheckpointHeaders, max_memory: int | None) -> tuple[int, str]:
    """The job process's peak while it computes the independent reference, and its formula
    in words. Whole (float32 weights within ``max_memory``): B + 1.4 x float32 weights. Layer
    by layer (``verification.independent``): B + 64 MiB + 1.7 x (one layer + what stays resident
    outside the stack, the embedding and head read from the file excluded, in
    the stored dtype) + 3 x n_ctx x vocab float32 logits (a causal LM with a tokenizer); a
    pickle (no headers) is bounded by ``max_memory``. Module by module (one layer x 1.7 in
    float32 over ``max_memory``): the same with the largest module in float32 instead of the
    layer, a plain projection counting as its row block (:data:`REFERENCE_LINEAR_BLOCK_BYTES`)
    at most: flat in the width."""
    weights = floating_elements(headers) * 4
    if max_memory is None or weights <= max_memory:
        held = int(REFERENCE_WHOLE_FACTOR * weights)
        return JOB_BASE_BYTES + held, (
            f"the independent reference (transformers, float32, whole): base + "
            f"{REFERENCE_WHOLE_FACTOR} x float32 weights ({held >> 20} MiB)"
        )
    layers = layer_count(headers)
    vocab = int((headers.config or {}).get("vocab_size") or 0)
    causal = causal_lm_with_tokenizer(headers)
    logits = REFERENCE_LOGITS_COPIES * REFERENCE_CTX * vocab * 4 if causal else 0
    if not headers.tensors or not layers:
        layer, rest = max_memory, 0
    else:
        floating = [t for t in headers.tensors if t.floating]
        layer = sum(t.nbytes for t in floating if ".layers." in t.name) // layers
        rest = sum(
            t.nbytes for t in floating if ".layers." not in t.name and not _read_from_file(t)
        )
    module = _largest_module(headers, max_memory)
    if module is not None:
        held = int(REFERENCE_WEIGHT_FACTOR * (module + rest))
        return JOB_BASE_BYTES + REFERENCE_BASE_BYTES + held + logits, (
            f"the independent reference (transformers, module by module: one layer x "
            f"{REFERENCE_WEIGHT_FACTOR} in float32 is over max_memory): base + 64 MiB + "
            f"{REFERENCE_WEIGHT_FACTOR} x (the largest module {module >> 20} MiB in float32, a "
            f"projection over {REFERENCE_LINEAR_BLOCK_BYTES >> 20} MiB in row blocks from the "
            f"file + resident rest {rest >> 20} MiB) + logits {logits >> 20} MiB"
        )
    held = int(REFERENCE_WEIGHT_FACTOR * (layer + rest))
    return JOB_BASE_BYTES + REFERENCE_BASE_BYTES + held + logits, (
        f"the independent reference (transformers, layer by layer): base + 64 MiB + "
        f"{REFERENCE_WEIGHT_FACTOR} x (one layer {layer >> 20} MiB + resident rest {rest >> 20} "
        f"MiB; embedding and head read from the file) + logits {logits >> 20} MiB"
    )



def _largest_module(headers: CheckpointHeaders, max_memory: int) -> int | None:
    """What a module-by-module reference holds of the layer stack at once, in float32 bytes:
    the largest weight it loads, a projection stored as plain floats counting as its row block
    at most, a layer's experts all together; None when one layer in float32 (x the factor) fits ``max_memory``, so the
    reference runs layer by layer (``verification.independent.reference_mode``)."""
    import re

    layers: dict[str, int] = {}
    stack = [t for t in headers.tensors if t.floating and ".layers." in t.name]
    for t in stack:
        if (found := re.search(r"\.layers\.(\d+)\.", t.name)) is not None:
            layers[found.group(1)] = layers.get(found.group(1), 0) + t.numel
    if max(layers.values(), default=0) * 4 * REFERENCE_WEIGHT_FACTOR <= max_memory:
        return None
    # a layer's experts are one module in transformers 5 (``gate_up_proj`` and ``down_proj``
    # packed): loaded together, whatever the checkpoint stores them as
    experts: dict[str, int] = {}
    for t in stack:
        if ".experts." in t.name:
            layer = t.name.split(".experts.")[0]
            experts[layer] = experts.get(layer, 0) + t.numel * 4
    return max(
        max(experts.values(), default=0),
        max((min(t.numel * 4, REFERENCE_LINEAR_BLOCK_BYTES)
             if len(t.shape) == 2 and t.dtype in REFERENCE_MAPPED_DTYPES else t.numel * 4
             for t in stack if ".experts." not in t.name), default=0),
    )  # fmt: skip


def with_independent_reference(plan: ExportPlan, inputs: PlanInputs) -> ExportPlan:
    """``plan`` with the independent reference's peak (:func:`reference_bytes`) when the job
    computes it first, as every verified job with a config does (an export whose formula
    already counts it, GGUF's or safetensors', does not call this)."""
    if not inputs.verify or inputs.headers.config is None:
        return plan
    reference, note = reference_bytes(inputs.headers, inputs.max_memory)
    return replace(
        plan, job_peak_rss_bytes=max(plan.job_peak_rss_bytes, reference),
        notes=(*plan.notes, note),
    )  # fmt: skip
