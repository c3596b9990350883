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
:data:`NEAR_TIE` of its type times the spread of its logits (their standard deviation over the
vocabulary). The table is the type's logit noise relative to that spread, with a factor of 3:
a logit moved by quantization noise of std ``r * spread`` moves a margin by ``sqrt(2) * r *
spread``, so a margin beyond ``3 r * spread`` flips with probability under 2 %. ``r`` is from
the measured KL of correct files (KL ~ r**2 spread**2 / 2 under the reference's distribution;
``gguf.llama_check``'s figures on SmolLM2, Qwen2.5 and Gemma 3, logit spreads ~2.5-3.5): q8_0
KL <= 0.0044 gives r <= 0.03; Q4_K_M <= 0.074, r <= 0.13; q4_0 <= 0.58, r <= 0.36; bf16
<= 0.0025, r <= 0.025; f16 <= 1.7e-4, r <= 0.006. On the near-tie Llama of the tests (std
0.02, hidden 256, logit spread 0.32): q8_0 KL 1.9e-5, r 0.019; Q4_K_M 0.0016, r 0.18; q4_0
0.0031, r 0.25. Each entry is 3 x the largest r (Q4_K_M: 0.6 from 0.18-0.2); the K-quants
between are interpolated by bits.

Judgement: a job fails on quality only against thresholds the request sets
(:class:`~service.verification.thresholds.QualityThresholds`: ``quality_below_threshold``), or
against the margin-aware default, top-1 on decided positions at least
:data:`DEFAULT_MIN_DECIDED_TOP1`: a decided position flips only when the file is wrong, so the
default fails a broken file (``verification_failed``) and never a correct one of a low-margin
model. numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.verification.logits import LogitFigures, scored
from service.verification.thresholds import QualityThresholds

NEAR_TIE: dict[str, float] = {
    "f32": 0.003,
    "f16": 0.02,
    "bf16": 0.08,
    "q8_0": 0.1,
    "Q6_K": 0.2,
    "Q5_K_S": 0.35,
    "Q5_K_M": 0.35,
    "Q4_K_S": 0.6,
    "Q4_K_M": 0.6,
    "IQ4_NL": 0.7,
    "IQ4_XS": 0.7,
    "q4_0": 1.1,
    "Q3_K_S": 1.5,
    "Q3_K_M": 1.3,
    "Q3_K_L": 1.2,
    "Q2_K": 2.5,
}
"""Margin (top-1 minus top-2 logit) below which a position is a near tie, relative to the
spread of its logits, by type: 3 x the type's relative logit noise (module docstring)."""
DEFAULT_NEAR_TIE = 1.0
"""For a type the table lacks: a q4-like noise, so few positions count as decided."""

DEFAULT_MIN_DECIDED_TOP1 = 0.9
"""The default judgement: top-1 agreement on decided positions. A correct file flips a decided
position with probability under 2 % by construction of :data:`NEAR_TIE`; a misread or
miswritten one (a skipped q/k permutation, raw FP8 codes) agrees on few."""


@dataclass(frozen=True)
class Margins:
    """The reference's margins at the scored positions, chunk by chunk in order."""

    margins: np.ndarray
    """top-1 minus top-2 logit at each scored position."""
    spreads: np.ndarray
    """Standard deviation of the position's logits over the vocabulary."""
    near_tie: np.ndarray
    """True where the margin is below the type's noise."""
    relative_noise: float

    @property
    def positions(self) -> int:
        return int(self.near_tie.size)

    @property
    def decided(self) -> int:
        return int((~self.near_tie).sum())

    def summary(self) -> dict[str, Any]:
        relative = self.margins / np.maximum(self.spreads, 1e-30)
        return {
            "near_tie_below": self.relative_noise,
            "near_tie_positions": self.positions - self.decided,
            "near_tie_share": (self.positions - self.decided) / max(1, self.positions),
            "decided_positions": self.decided,
            "median_margin": float(np.median(self.margins)),
            "median_relative_margin": float(np.median(relative)),
        }


def reference_margins(logits: Iterable[np.ndarray], n_ctx: int, type_name: str) -> Margins:
    """The margins of the reference's chunk ``logits`` (``(n_ctx, vocab)`` each) over the
    scored window, near ties by ``type_name``'s noise (:data:`NEAR_TIE`)."""
    window = scored(n_ctx)
    margins, spreads = [], []
    for chunk in logits:
        rows = np.asarray(chunk[window], dtype=np.float64)
        top2 = np.partition(rows, -2, axis=-1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
        spreads.append(rows.std(axis=-1))
    margin, spread = np.concatenate(margins), np.concatenate(spreads)
    relative = NEAR_TIE.get(type_name, DEFAULT_NEAR_TIE)
    return Margins(margin, spread, margin < relative * spread, relative)


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
