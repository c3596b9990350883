"""What a safetensors export holds in memory and writes to disk, from the checkpoint's headers.

The terms every format shares (the job's base, the independent reference) are
:mod:`service.plan.terms`; :meth:`SafetensorsExporter.plan` hands this formula to the service.
"""

from __future__ import annotations

from typing import Any

from service.checkpoint.headers import ITEMSIZE, CheckpointHeaders
from service.plan import ExportPlan, PlanInputs, VerificationMode
from service.plan.terms import (
    JOB_BASE_BYTES,
    MiB,
    floating_elements,
    reference_bytes,
    tied_head_bytes,
)

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


def plan_safetensors(spec: Any, inputs: PlanInputs) -> ExportPlan:
    """Shards written tensor by tensor (a cast block at a time); verified by running the source
    and the export in transformers with the weights resident within ``max_memory``."""
    headers, max_memory, verify = inputs.headers, inputs.max_memory, inputs.verify
    out_itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(spec.dtype), None)
    artifact = 0
    for t in headers.tensors:
        size = ITEMSIZE[t.dtype] if out_itemsize is None or not t.floating else out_itemsize
        artifact += t.numel * size
    artifact = (artifact or headers.weight_bytes) - tied_head_bytes(headers)
    casts = out_itemsize is not None and any(
        t.floating and ITEMSIZE[t.dtype] != out_itemsize for t in headers.tensors
    )
    # A stack packed from small experts' tensors is read in pieces larger than any of them:
    # the plan cannot tell which tensors transformers packs (the API process has no torch), so
    # a conversion of the experts' layout is planned at the ring's full size.
    converts = getattr(spec, "experts", None) is not None
    ring = SAFETENSORS_SLOTS * SAFETENSORS_CHUNK_BYTES if converts else _ring_bytes(headers)
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
        resident = min(max_memory, floating_elements(headers) * 4)
        peak = max(writing, JOB_BASE_BYTES + int(SAFETENSORS_VERIFY_FACTOR * resident))
        verification = "reference"
        notes.append(
            f"verifying: base + {SAFETENSORS_VERIFY_FACTOR} x float32 weights resident within "
            f"max_memory ({resident >> 20} MiB)"
        )
        reference, note = reference_bytes(headers, max_memory)
        peak = max(peak, reference)
        notes.append(note)
    return ExportPlan(
        format="safetensors", job_peak_rss_bytes=peak, job_rss_during_children_bytes=peak,
        verification=verification, artifact_bytes=artifact, notes=tuple(notes),
    )  # fmt: skip

