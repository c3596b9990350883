"""What a GGUF export holds in memory and writes to disk, from the checkpoint's headers.

Not to be confused with :mod:`.layout`, what the GGUF file holds (llama.cpp's converter asked
about the checkpoint), which a job computes when it runs. The terms every format shares (the
job's base, the independent reference) are :mod:`service.plan.terms`;
:meth:`GGUFExporter.plan` hands this formula to the service.
"""

from __future__ import annotations

from typing import Any

from service.checkpoint.headers import CheckpointHeaders, TensorHeader
from service.checkpoint.vision import is_multimodal, is_vision_tensor
from service.config import QUANTIZER_BUFFER
from service.exporters.gguf.mmproj import MTMD_ON_F16
from service.plan import ChildPlan, ExportPlan, PlanInputs
from service.plan.terms import (
    JOB_BASE_BYTES,
    REFERENCE_BASE_BYTES,
    REFERENCE_WEIGHT_FACTOR,
    MiB,
    causal_lm_with_tokenizer,
    floating_elements,
    reference_bytes,
    tied_head_bytes,
)

CHUNK_BYTES = 64 * MiB
"""The GGUF writer's row block of float32 (``blocks.CHUNK_BYTES``)."""

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
"""llama-quantize beyond its tensors (bench/export_gguf.py)."""
QUANTIZER_OUT_BYTES = 34 / 32
"""The most a llama-quantize mixture writes per weight (a Q8_0 tensor; Q6_K is 0.82)."""

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

GGUF_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
    "q2_k": 2.63 / 8, "q3_k_s": 3.5 / 8, "q3_k_m": 3.91 / 8, "q3_k_l": 4.27 / 8,
    "q4_k_s": 4.58 / 8, "q4_k_m": 4.89 / 8, "q5_k_s": 5.54 / 8, "q5_k_m": 5.69 / 8,
    "q6_k": 6.56 / 8, "iq4_nl": 4.5 / 8, "iq4_xs": 4.25 / 8,
}  # fmt: skip
"""Bytes per weight of a matrix stored in each GGUF type (llama-quantize's averages for the
K-quant mixtures); vectors (norms, biases) stay float32."""

UNQUANTIZED_GGUF = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0"})


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
    total -= int(tied_head_bytes(headers) / 4 * per) if tied_head_bytes(headers) else 0
    vocab = int((headers.config or {}).get("vocab_size") or 0)
    return total + vocab * 24  # tokens, scores, types and merges


def _transformed(headers: CheckpointHeaders) -> int:
    """Float32 bytes of the largest tensor llama.cpp's converter evaluates whole: a q/k
    projection it permutes (Llama-family classes); a MoE layer's experts stream one after the
    other and are not counted."""
    permuted = [t for t in headers.tensors if t.name.endswith(("q_proj.weight", "k_proj.weight"))]
    return max((t.numel * 4 for t in permuted), default=0)



def quantizer_plan(largest: TensorHeader | None, f16_bytes: int, buffer: int) -> ChildPlan:
    """llama-quantize's peak: Q + R + 2 L, of which 2 L is mapped.

    ``L`` the elements of the largest tensor, whose f16 rows it maps (clean page cache,
    unmapped after each tensor). ``R`` its row block: ``--max-buffer-size`` (``buffer``)
    bytes of rows, counted as llama.cpp counts them (f16 in, float32 converted, quantized
    out: ``rows = buffer / (n x (6 + q))``, q = 34/32 the widest output, Q8_0), never less
    than one row and never more than the whole tensor; it holds ``rows x n x (2 x 4 + q)``:
    the float32 rows twice, since the conversion buffer is a ``std::vector`` that grows by
    copying (a block of ``token_embd``'s Q4_K rows is larger than one of the Q6_K ``output``
    before it: measured 344 MiB anonymous with 256 MiB blocks, vocabulary 65536 x 1024, where
    one float32 copy is 156 MiB). No term grows with a tensor beyond the block but the mapped
    one."""
    elements = largest.numel if largest is not None else f16_bytes // 2
    row = largest.shape[-1] if largest is not None and largest.shape else elements
    rows = max(1, min(elements // max(1, row), int(buffer // (row * (6 + QUANTIZER_OUT_BYTES)))))
    block = int(rows * row * (2 * 4 + QUANTIZER_OUT_BYTES))
    return ChildPlan("llama-quantize", QUANTIZER_BASE_BYTES + block + 2 * elements, 2 * elements)


def plan_gguf(spec: Any, inputs: PlanInputs) -> ExportPlan:
    """B + G + C x m + T: the job's base, the converter and vocabulary, ``m`` row blocks of
    ``C`` float32 bytes (by written type, less with the read-back off), and the largest tensor
    llama.cpp's converter evaluates whole (a permuted q/k projection; a MoE layer's experts
    stream one after the other and add nothing). A K-quant writes the f16 file that way, then
    llama-quantize (Q + R + 2 L: its row block of ``quantizer_buffer`` and the largest
    tensor's f16 rows mapped, :func:`quantizer_plan`) and, verified, llama.cpp's perplexity
    and tokenizer checks, each mapping a file, run as children."""
    headers, max_memory = inputs.headers, inputs.max_memory
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
        reference, notes_reference = reference_bytes(headers, max_memory)
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
        settings = inputs.settings
        buffer = settings.quantizer_buffer if settings is not None else QUANTIZER_BUFFER
        quantizer = quantizer_plan(largest, f16, buffer)
        children.append(quantizer)
        if spec.verify:
            children.append(ChildPlan("llama-perplexity", LLAMA_CHECK_BASE_BYTES + f16, f16))
        block = quantizer.peak_rss_bytes - quantizer.mapped_bytes - QUANTIZER_BASE_BYTES
        notes.append(
            f"llama-quantize: Q {QUANTIZER_BASE_BYTES >> 20} MiB + R {block >> 20} MiB (its row "
            f"block of {buffer >> 20} MiB, or the whole tensor: float32 rows twice, quantized "
            "rows) + "
            f"2 x L {quantizer.mapped_bytes >> 20} MiB mapped (the largest tensor's f16 rows); "
            f"llama-perplexity maps the f16 file ({f16 >> 20} MiB)"
        )
    elif spec.verify and causal_lm_with_tokenizer(headers):
        # the logits check against the reference: llama.cpp maps the GGUF file itself
        children.append(ChildPlan("llama-perplexity", LLAMA_CHECK_BASE_BYTES + artifact, artifact))
        notes.append(f"llama-perplexity maps the file ({artifact >> 20} MiB)")
    if is_multimodal(headers.config):
        job, artifact = _plan_vlm(spec, headers, type_name, job, artifact, children, notes)
        if spec.verify and type_name in MTMD_ON_F16:  # the f16 text file its mtmd check runs
            scratch = _gguf_bytes(headers, "f16")
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
    (``mmproj-*.gguf``, f32 beside f32, else f16: ``gguf.mmproj.mmproj_type``) instead
    of the text file, written by the same streaming writer (no more row blocks). Verified, the
    mtmd check (for a llama-quantize type on the f16 file it quantized, for q8_0/q4_0 on an f16
    file written for it) runs transformers' whole VLM in float32 in the job
    (B + 64 MiB + 1.7 x float32 weights, whatever ``max_memory``) and llama-mtmd-cli, which
    maps the text file and loads the projector (:func:`_mtmd_peak`). Returns the job's
    peak and the artifact's bytes; appends the child and the notes."""
    vision = [t for t in headers.tensors if is_vision_tensor(t.name)]
    per_text = GGUF_TYPE_BYTES.get(type_name, 2.0)
    per_projector = 4.0 if type_name == "f32" else 2.0
    in_text = sum(int(t.numel * (per_text if _gguf_matrix(t) else 4)) for t in vision)
    projector = sum(int(t.numel * (per_projector if _gguf_matrix(t) else 4)) for t in vision)
    text = max(0, artifact - in_text)
    notes.append(
        f"projector: {len(vision)} vision tensors, {projector >> 20} MiB, streamed like the text "
        "model's"
    )
    if not spec.verify:
        return job, text + projector
    # a llama-quantize type's check runs on the f16 file it was made from, a q8_0/q4_0's on an
    # f16 file written for it (mmproj.MTMD_ON_F16): scaled back to f16
    on_f16 = type_name not in UNQUANTIZED_GGUF or type_name in MTMD_ON_F16
    mapped = int(text * 2.0 / per_text) if on_f16 else text
    weights = floating_elements(headers) * 4
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

