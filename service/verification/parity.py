"""How an export's outputs are judged against the source's: one tolerance table, one comparison,
one report.

Every format is checked by running the written files and comparing their outputs with PyTorch's
on the source weights: safetensors by transformers again
(:mod:`service.exporters.safetensors.verify`), NNEF by tract and ONNX by onnxruntime, each in a
child process. The figure is the largest
absolute difference over every compared output, accepted up to ``atol + rtol * max|reference|``
(:class:`Tolerance`), the bound depending on who runs the export (:data:`TOLERANCES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from service.errors import VerificationFailed
from service.tensors import dtype_name

Runner = Literal["torch", "runtime"]
"""Who runs the export in its check: ``torch`` (the export's own weights, reloaded by
transformers: safetensors) or ``runtime`` (another runtime on the same weights: tract,
onnxruntime)."""


@dataclass(frozen=True)
class Tolerance:
    """The accepted error of an output: ``atol + rtol * max|reference|``."""

    atol: float
    rtol: float

    def bound(self, reference_max_abs: float) -> float:
        return self.atol + self.rtol * reference_max_abs

    def overridden(self, atol: float | None, rtol: float | None) -> Tolerance:
        """This tolerance with a request's own ``atol``/``rtol`` where it gives them."""
        return Tolerance(atol or self.atol, self.rtol if rtol is None else rtol)


TOLERANCES: dict[Runner, dict[str, Tolerance]] = {
    "torch": {
        "float64": Tolerance(0.0, 1e-5),
        "float32": Tolerance(0.0, 1e-5),
        "float16": Tolerance(0.0, 2e-2),
        "bfloat16": Tolerance(0.0, 6e-2),
        "q8_0": Tolerance(0.0, 6e-2),
        "q4_0": Tolerance(0.0, 0.3),
    },
    "runtime": {
        "float32": Tolerance(1e-3, 1e-3),
        "float16": Tolerance(2e-2, 2e-2),
        "q4_0": Tolerance(1e-2, 1e-2),
    },
}
"""Accepted error by runner and by export dtype (or quantization).

``torch``: the same kernels on cast weights, so float32 only absorbs summation-order noise; half
precisions allow the rounding of every weight (2^-11 and 2^-8 relative) compounded through the
layers; GGML blocks add their block error. ``runtime``: another runtime's kernels on the same
weights; q4_0 is compared with the same q4_0 weights dequantized in PyTorch, so it differs from
float32 only by kernels. A runtime check of a dtype not listed (bfloat16) is held to float16's.
"""


def tolerance_for(runner: Runner, dtype: Any) -> Tolerance:
    """The tolerance of ``dtype`` (a torch dtype or its name, or q8_0/q4_0) for ``runner``;
    :class:`VerificationFailed` when a torch check has none for it."""
    name = dtype_name(dtype)
    table = TOLERANCES[runner]
    if name in table:
        return table[name]
    if runner == "runtime":
        return table["float16"]
    raise VerificationFailed(f"no verification tolerance for {name}")


@dataclass(frozen=True)
class Comparison:
    """Outputs compared with the reference's (:func:`compare_outputs`)."""

    max_abs_error: float
    reference_max_abs: float
    tolerance: float
    """The absolute bound: ``atol + rtol * reference_max_abs``."""
    finite: bool
    mismatch: str | None = None
    """Why the outputs could not be compared at all (their shapes or counts), else None."""

    @property
    def max_rel_error(self) -> float:
        """``max_abs_error`` relative to the largest reference magnitude (absolute if zero)."""
        return self.max_abs_error / (self.reference_max_abs or 1.0)

    @property
    def passed(self) -> bool:
        return self.mismatch is None and self.finite and self.max_abs_error <= self.tolerance

    def unjudgeable(self, runtime: str) -> str | None:
        """Why no tolerance can judge these outputs (a shape mismatch, a non-finite value)."""
        if self.mismatch is not None:
            return f"{runtime} {self.mismatch}"
        if not self.finite:
            return f"{runtime} produced non-finite values"
        return None


def compare_outputs(
    found: Sequence[np.ndarray], expected: Sequence[np.ndarray], tolerance: Tolerance
) -> Comparison:
    """The largest absolute difference of ``found`` from ``expected`` (PyTorch's, on the
    source weights), pairwise, and the bound ``tolerance`` sets for it."""
    if len(found) != len(expected):
        counts = f"gave {len(found)} outputs, PyTorch {len(expected)}"
        return Comparison(0.0, 0.0, 0.0, True, counts)
    err = 0.0
    ref = 0.0
    finite = True
    for f, e in zip(found, expected, strict=True):
        if f.shape != e.shape:
            return Comparison(0.0, 0.0, 0.0, True, f"output shape {f.shape} != PyTorch {e.shape}")
        finite = finite and bool(np.all(np.isfinite(f)))
        diff = np.abs(f.astype(np.float64) - e.astype(np.float64))
        err = max(err, float(diff.max(initial=0.0)))
        ref = max(ref, float(np.abs(e).max(initial=0.0)))
    return Comparison(err, ref, tolerance.bound(ref), finite)


def relative_agreement(reference: Any, candidate: Any, rtol: float) -> dict[str, Any]:
    """``candidate`` (a torch tensor) against ``reference`` within ``rtol`` of the largest
    reference magnitude, as a manifest records it: ``passed``, the absolute and relative errors,
    the tolerance, and whether the outputs are finite; ``reason`` when they cannot be compared."""
    result = compare_outputs(
        [candidate.detach().float().numpy()], [reference.detach().float().numpy()],
        Tolerance(0.0, rtol),
    )  # fmt: skip
    if result.mismatch is not None:
        return {"passed": False, "reason": result.mismatch}
    return {
        "passed": result.passed,
        "max_abs_error": result.max_abs_error,
        "max_rel_error": result.max_rel_error,
        "reference_max_abs": result.reference_max_abs,
        "tolerance": rtol,
        "finite": result.finite,
    }


@dataclass(frozen=True)
class ParityReport:
    """A runtime's check of an export (tract for NNEF, onnxruntime for ONNX), for the manifest."""

    child: str
    """The runtime's short name, prefixing its peak RSS in the manifest (``tract``, ``ort``)."""
    max_abs_err: float
    ref_max_abs: float
    tolerance: float
    compared: int
    """Output vectors compared (decode steps + 1 for an LLM, outputs for an encoder)."""
    tokens: list[int] = field(default_factory=list)
    """PyTorch's greedy tokens (causal LMs)."""
    argmax_agreed: list[bool] = field(default_factory=list)
    """Whether the runtime's argmax was PyTorch's token at each step (causal LMs)."""
    peak_rss_bytes: int = 0
    """Peak RSS of the runtime's child process (the weights it holds or maps included)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The runtime's own figures for the manifest (how it held the weights, say)."""

    @classmethod
    def of(
        cls,
        child: str,
        comparison: Comparison,
        compared: int,
        tokens: list[int] | None = None,
        argmax_agreed: list[bool] | None = None,
        *,
        peak_rss_bytes: int,
        extra: dict[str, Any] | None = None,
    ) -> ParityReport:
        return cls(
            child, comparison.max_abs_error, comparison.reference_max_abs, comparison.tolerance,
            compared, tokens or [], argmax_agreed or [], peak_rss_bytes, extra or {},
        )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The export's ``verify`` in the manifest."""
        return {
            "max_abs_err": self.max_abs_err,
            "ref_max_abs": self.ref_max_abs,
            "tolerance": self.tolerance,
            "compared": self.compared,
            "tokens": list(self.tokens),
            "argmax_agreed": list(self.argmax_agreed),
            f"{self.child}_peak_rss_bytes": self.peak_rss_bytes,
            **self.extra,
        }
