"""How much a lossy type cost, read with the reference's own margins: the quality report.

Quantization moves every logit by a small fraction of the logits' spread. Where the reference's
top-1 token leads its top-2 by less than that, the top-1 of a **correct** file flips by chance:
a model with near-tie logits (random init, an early checkpoint, text it does not know) shows
top-1 agreement well below a decisive model's for the same file quality (issue 35: a correct
q8_0 of a std-0.02 Llama agreed on 0.83 of its positions). So the report says, beside KL, p99
KL, top-1 and perplexity ratio against the float source, how many scored positions are such
near ties, and the top-1 agreement on the others (*decided* positions), where a flip is not
chance but a fault.

A position is a near tie when its reference margin (top-1 logit minus top-2) is below
:data:`NEAR_TIE_FACTOR` times the file's logit noise. That noise is measured, not assumed:
``sqrt(2 * mean KL)`` nats, since a logit perturbation of std ``sigma`` under the reference's
distribution costs a KL of about ``sigma**2 / 2``; a perturbation of that size moves a margin by
``sqrt(2) * sigma``, so a margin beyond ``3 sigma`` flips by chance with probability under 2 %.
It is capped by the type's ceiling (:data:`NOISE_CEILING`), twice the largest noise a correct
file of the type showed: a broken file's KL (~1-10) would otherwise call every position a tie
and nothing decided. Measured: q8_0 KL 0.0044 at most (sigma 0.094) on SmolLM2, Qwen2.5 and
Gemma 3 (``gguf.llama_check.CALIBRATED_FIGURES``), Q4_K_M 0.074 (0.38), q4_0 0.58 (1.08), bf16
0.0025 (0.07), f16 1.7e-4 (0.018); the near-tie Llama of the tests (std 0.02, hidden 256): q8_0
1.9e-5 (0.006) with median margin 0.039, Q4_K_M 0.0016 (0.057).

Judgement: a job fails on quality only against thresholds the request sets
(:class:`~service.verification.thresholds.QualityThresholds`: ``quality_below_threshold``), or
against the margin-aware default, top-1 on decided positions at least
:data:`DEFAULT_MIN_DECIDED_TOP1`: a decided position flips only when the file is wrong, so the
default fails a broken file (``verification_failed``) and never a correct one of a low-margin
model. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.verification.logits import LogitFigures, scored
from service.verification.thresholds import QualityThresholds

NEAR_TIE_FACTOR = 3.0
"""A margin below this many times the logit noise is a near tie (module docstring)."""
NOISE_CEILING: dict[str, float] = {
    "f32": 0.05,
    "f16": 0.05,
    "bf16": 0.15,
    "q8_0": 0.2,
    "Q6_K": 0.3,
    "Q5_K_S": 0.5,
    "Q5_K_M": 0.5,
    "Q4_K_S": 0.8,
    "Q4_K_M": 0.8,
    "IQ4_NL": 0.9,
    "IQ4_XS": 0.9,
    "q4_0": 2.2,
    "Q3_K_S": 2.5,
    "Q3_K_M": 2.5,
    "Q3_K_L": 2.5,
    "Q2_K": 4.0,
}
"""The largest logit noise (nats) a file of each type is credited with: twice the largest a
correct file showed (module docstring); K-quants between measured types by their bits."""
DEFAULT_NOISE_CEILING = 1.0
"""For a type the table lacks."""

DEFAULT_MIN_DECIDED_TOP1 = 0.9
"""The default judgement: top-1 agreement on decided positions. A correct file flips a decided
position with probability under 2 % by construction of :data:`NEAR_TIE_FACTOR`; a misread or
miswritten one (a skipped q/k permutation, raw FP8 codes) agrees on few."""


@dataclass(frozen=True)
class Margins:
    """The reference's margins at the scored positions, chunk by chunk in order."""

    margins: np.ndarray
    """top-1 minus top-2 logit at each scored position."""
    noise: float
    """The file's logit noise (nats) the margins are read against."""
    measured: bool
    """Whether ``noise`` is the measured one (else the type's ceiling)."""

    @property
    def near_tie(self) -> np.ndarray:
        """True where the margin is below :data:`NEAR_TIE_FACTOR` x the noise."""
        result: np.ndarray = self.margins < NEAR_TIE_FACTOR * self.noise
        return result

    @property
    def positions(self) -> int:
        return int(self.margins.size)

    @property
    def decided(self) -> int:
        return int((~self.near_tie).sum())

    def summary(self) -> dict[str, Any]:
        return {
            "noise_nats": self.noise,
            "noise": "measured: sqrt(2 x mean KL)" if self.measured else "the type's ceiling",
            "near_tie_below_nats": NEAR_TIE_FACTOR * self.noise,
            "near_tie_positions": self.positions - self.decided,
            "near_tie_share": (self.positions - self.decided) / max(1, self.positions),
            "decided_positions": self.decided,
            "median_margin": float(np.median(self.margins)),
        }


def reference_margins(
    logits: Iterable[np.ndarray], n_ctx: int, type_name: str, kl_mean: float
) -> Margins:
    """The margins of the reference's chunk ``logits`` (``(n_ctx, vocab)`` each) over the
    scored window, read against the noise of a file of ``type_name`` whose mean KL from the
    reference is ``kl_mean`` (module docstring)."""
    window = scored(n_ctx)
    margins = []
    for chunk in logits:
        rows = np.asarray(chunk[window], dtype=np.float64)
        top2 = np.partition(rows, -2, axis=-1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
    ceiling = NOISE_CEILING.get(type_name, DEFAULT_NOISE_CEILING)
    measured = math.sqrt(2 * max(kl_mean, 0.0)) if math.isfinite(kl_mean) else math.inf
    return Margins(np.concatenate(margins), min(measured, ceiling), measured <= ceiling)


def requested_violations(
    figures: LogitFigures, decided_top1: float | None, thresholds: QualityThresholds
) -> list[str]:
    """What the figures break of the request's thresholds, one phrase each."""
    checks = [
        ("max_kl", figures.kl_mean, "mean KL", False),
        ("max_kl_p99", figures.kl_p99, "p99 KL", False),
        ("min_top1", figures.top1, "top-1 agreement", True),
        ("min_decided_top1", decided_top1, "top-1 agreement on decided positions", True),
        ("max_ppl_ratio", figures.ppl_ratio, "perplexity ratio", False),
    ]
    out = []
    for key, value, what, at_least in checks:
        bound = getattr(thresholds, key)
        if bound is None or value is None:
            continue
        if at_least and not value >= bound:  # NaN fails too
            out.append(f"{what} {value:.4f} < {bound} (min_{key[4:]})")
        elif not at_least and not value <= bound:
            out.append(f"{what} {value:.5f} > {bound} ({key})")
    return out


def default_violation(decided_top1: float | None, margins: Margins) -> str | None:
    """The margin-aware default's phrase when the file fails it, else None (also when no
    position is decided: nothing a correct file could not show)."""
    if decided_top1 is None or decided_top1 >= DEFAULT_MIN_DECIDED_TOP1:
        return None
    return (
        f"top-1 agreement on decided positions {decided_top1:.4f} < {DEFAULT_MIN_DECIDED_TOP1} "
        f"({margins.decided} of {margins.positions} positions lead by more than the type's noise)"
    )
