"""Is the q4_0 archive what we meant to write? tract's logits against PyTorch's run of the
archive's *own* weights: an exact check, the float archive's tolerance, for any model.

torch-to-nnef's ``min_max_q4_0`` replaces each Linear weight by a q4_0 tensor
(``QTensorTractScaleOnly``): 4-bit codes and one float16 scale per block of 32, which is what
the archive stores and what tract reads. The export compresses the job's offloaded model in
place (``LLMExporter.prepare``) before anything is traced; that model, whose compressed
weights dequantize on use (``(code - 8) * scale``, eagerly: ``shims.torch_to_nnef.
eager_q4_dequantize``) and whose other weights stream from the offload store, is the reference
here, run as the decode check's ``greedy_reference`` is run: one forward over the fixed text's
chunks as a batch (:func:`own_chunk_logits`), every weight read once, one at a time.

Why float32's tolerance (``parity.TOLERANCES["runtime"]["float32"]``): a code times an f16
scale is exactly representable in float32, so PyTorch's dequantized weight *is* the archive's
weight, value for value, and both sides multiply float32 activations by the same float32
weights. However tract's kernels pack the blocks, they multiply the same values, with float32
activations; what is left between the two runs is the order of float32 accumulation and
tract's exp/rope, what separates tract from PyTorch on a float32 archive. Measured on 2 layers
of SmolLM2: max abs error 9.5e-5 on the fixed text's logits (max |logit| 76, tolerance 0.077)
and 8.4e-5 on the decode; a tiny BERT encoder's q4_0 archive 2.2e-8 (tolerance 1.1e-3). No quantization error is left to absorb: a bound that
absorbed it (the q4_0 logit bounds this check replaces, KL 1.0 and top-1 0.5 against the float
source) is both a false failure for a low-margin model and loose enough to let a small fault
through. A fault (a flipped block, a mis-scaled block, a wrong tensor mapping) moves the
logits by the size of the weights it touches, far beyond float32 noise.

How much q4_0 cost is the other question, answered against the float source (the job's
independent reference) with the same figures as GGUF's quality report (KL, p99 KL, top-1, top-1
on decided positions, perplexity ratio, the reference's margins:
:mod:`service.verification.quality`): reported always, judged only against the thresholds the
request sets (``"verify": {"max_kl": ...}``, ``quality_below_threshold``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import QualityBelowThreshold, VerificationFailed
from service.verification.logits import compare_logits, placed_rows, scored
from service.verification.parity import Tolerance, compare_outputs, tolerance_for
from service.verification.quality import reference_margins, requested_violations

if TYPE_CHECKING:
    from collections.abc import Callable

    from service.verification.thresholds import QualityThresholds

EXACT_RUNTIME_DTYPE = "float32"
"""The dtype whose runtime tolerance the exact check uses (module docstring)."""


def exact_tolerance() -> Tolerance:
    """tract float32's tolerance: what a compressed archive is held to against its own weights."""
    return tolerance_for("runtime", EXACT_RUNTIME_DTYPE)


def own_chunk_logits(model: Any, chunks: np.ndarray) -> np.ndarray:
    """The scored window's logits ``(n_chunk, window, vocab)`` of ``model`` (the compressed,
    offloaded causal LM the archive was traced from) on the fixed text's ``chunks``: one
    cache-less forward over the chunks as a batch, so one pass over the weights."""
    import torch

    window = scored(int(chunks.shape[1]))
    ids = torch.from_numpy(np.asarray(chunks, dtype=np.int64))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    rows = logits[:, window].float().as_subclass(torch.Tensor)
    return np.ascontiguousarray(rows.numpy(), dtype=np.float32)


def judge_compressed(
    found: np.ndarray,
    own: np.ndarray,
    reference: Any,
    compression: str,
    thresholds: QualityThresholds | None,
    where: Callable[[], str],
) -> dict[str, Any]:
    """The exact check, then the quality report, of tract's fixed-text logits ``found``
    (``(n_chunk, window, vocab)``): against ``own`` (:func:`own_chunk_logits`) within
    :func:`exact_tolerance` (VerificationFailed beyond it, saying ``where()`` tract first
    diverges), then against the float source (``reference``, the job's independent reference),
    failing only below the request's ``thresholds`` (QualityBelowThreshold)."""
    chunks = reference.chunks
    tolerance = exact_tolerance()
    comparison = compare_outputs(list(found), list(own), tolerance)
    problem = comparison.unjudgeable("tract")
    if problem is not None:
        raise VerificationFailed(f"{problem}; {where()}")
    if not comparison.passed:
        raise VerificationFailed(
            f"{compression} NNEF archive is not what was meant to be written: tract's logits on "
            f"the fixed text differ from PyTorch's run of the archive's own {compression} weights "
            f"(dequantized as stored) by {comparison.max_abs_error:.3g} (tolerance "
            f"{comparison.tolerance:.3g}, float32's); {where()}"
        )
    logits = reference.chunk_logits()
    found_full = placed_rows(found, chunks)
    figures = compare_logits(logits, found_full, chunks)
    margins = reference_margins(logits, int(chunks.shape[1]), compression, figures.kl_mean)
    decided_top1 = _decided_top1(logits, found_full, chunks, margins.near_tie)
    report: dict[str, Any] = {
        "reference": reference.summary()["implementation"],
        **figures.as_dict(),
        "decided_top1": decided_top1,
        "margins": margins.summary(),
        "thresholds": thresholds.set_thresholds() if thresholds is not None else None,
        "exact": {
            "reference": f"PyTorch on the archive's own {compression} weights (dequantized "
            "as stored)",
            "max_abs_error": comparison.max_abs_error,
            "reference_max_abs": comparison.reference_max_abs,
            "tolerance": comparison.tolerance,
            "tolerance_of": asdict(tolerance) | {"dtype": EXACT_RUNTIME_DTYPE},
            "positions": int(np.prod(found.shape[:2])),
        },
    }
    if thresholds is not None:
        failed = requested_violations(figures, decided_top1, thresholds)
        if failed:
            raise QualityBelowThreshold(
                f"{compression} NNEF archive run by tract is below the requested quality on the "
                f"fixed text: {'; '.join(failed)} (near ties: "
                f"{margins.positions - margins.decided} of {margins.positions} positions)"
            )
    return report


def _decided_top1(
    reference: list[np.ndarray], found: list[np.ndarray], chunks: np.ndarray,
    near_tie: np.ndarray,
) -> float | None:  # fmt: skip
    """Top-1 agreement on the scored positions that are not near ties (None: none is)."""
    window = scored(int(chunks.shape[1]))
    same = [
        np.asarray(ref)[window].argmax(-1) == np.asarray(art)[window].argmax(-1)
        for ref, art in zip(reference, found, strict=True)
    ]
    decided = ~near_tie
    if not decided.any():
        return None
    return float(np.concatenate(same)[decided].mean())
