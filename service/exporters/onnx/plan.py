"""What an ONNX export holds in memory and writes to disk, from the checkpoint's headers.

The terms every format shares (the job's base, the independent reference) are
:mod:`service.plan.terms`; :meth:`ONNXExporter.plan` hands this formula to the service.
"""

from __future__ import annotations

from typing import Any

from service.plan import ChildPlan, ExportPlan, PlanInputs
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


def plan_onnx(spec: Any, inputs: PlanInputs) -> ExportPlan:
    """The job's base + 128 MiB + the largest tensor (twice when cast) + 4.5 MiB per layer;
    onnxruntime maps every weight: 40 MiB + the weights' pages. The job checks its model
    against the independent reference first (:func:`with_independent_reference`)."""
    headers = inputs.headers
    itemsize = export_dtype_bytes(headers, spec.dtype)
    largest = largest_bytes(headers, itemsize)
    cast = headers.source_dtype not in (None, {4: "F32", 2: "F16"}[itemsize])
    layers = layer_count(headers)
    job = (
        JOB_BASE_BYTES
        + ONNX_BASE_BYTES
        + largest * (2 if cast else 1)
        + layers * ONNX_PER_LAYER_BYTES
    )
    weights = floating_elements(headers) * itemsize - tied_head_bytes(headers) // 4 * itemsize
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
    plan = ExportPlan(
        format="onnx", job_peak_rss_bytes=job, job_rss_during_children_bytes=job,
        children=children, verification="whole" if spec.verify else "none",
        artifact_bytes=weights, offload_bytes=0,
        notes=((f"job: base + largest tensor {largest >> 20} MiB{' x 2 (cast)' if cast else ''} "
               f"+ {layers} layers x 4.5 MiB; onnxruntime: 40 MiB + mapped weights "
               f"({weights >> 20} MiB)"),),
    )  # fmt: skip
    return with_independent_reference(plan, inputs)
