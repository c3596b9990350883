"""service.verification.quality: the reference's margins, near ties by the type's noise, and
what fails a job (the request's thresholds, the margin-aware default); the base file that makes
llama.cpp count top-1 agreement on decided positions only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from service.exporters.gguf import GGUFSpec
from service.verification.llama_kl import write_llama_base_logits
from service.verification.logits import LogitFigures, chunk_tokens, scored
from service.verification.quality import (
    NOISE_CEILING,
    default_violation,
    reference_margins,
    requested_violations,
)
from service.verification.thresholds import QualityThresholds
from tests.unit.verification.test_logits import _read_base

N_CTX, VOCAB = 16, 40


def _logits(margin: float, spread: float = 1.0) -> list[np.ndarray]:
    """Two chunks whose scored rows have logits of std ~``spread`` and top-1 leading by ``margin``."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        x = rng.normal(0, spread, (N_CTX, VOCAB))
        x[:, 0] = x[:, 1:].max(axis=1) + margin
        out.append(x.astype(np.float32))
    return out


def test_a_margin_below_three_times_the_files_measured_noise_is_a_near_tie() -> None:
    # a KL of 0.0008 is a logit noise of 0.04 nats: margins of 0.05 are ties, of 2 decided
    tight = reference_margins(_logits(0.05), N_CTX, "q8_0", kl_mean=0.0008)
    assert tight.noise == pytest.approx(0.04) and tight.measured
    assert tight.positions == 2 * (N_CTX // 2 - 1) and tight.decided == 0
    assert reference_margins(_logits(0.05), N_CTX, "q8_0", kl_mean=1e-6).decided == tight.positions
    clear = reference_margins(_logits(2.0), N_CTX, "Q4_K_M", kl_mean=0.05)
    assert clear.decided == clear.positions
    summary = clear.summary()
    assert summary["near_tie_share"] == 0.0 and summary["median_margin"] == pytest.approx(2.0, abs=1e-5)


def test_a_broken_files_noise_is_capped_by_its_types_ceiling() -> None:
    """KL 5 (a misread file) would make every position a tie: the type's ceiling keeps the
    decided ones decided, so the default can still fail the file."""
    assert NOISE_CEILING["f16"] < NOISE_CEILING["q8_0"] < NOISE_CEILING["Q4_K_M"] < NOISE_CEILING["q4_0"]
    for kl in (5.0, float("nan")):
        broken = reference_margins(_logits(2.0), N_CTX, "q8_0", kl_mean=kl)
        assert broken.noise == NOISE_CEILING["q8_0"] and not broken.measured
        assert broken.decided == broken.positions


FIGURES = LogitFigures(kl_mean=0.3, kl_p99=1.2, top1=0.8, ppl_ratio=1.1, positions=126)


def test_only_the_thresholds_the_request_sets_are_judged() -> None:
    assert requested_violations(FIGURES, 0.95, QualityThresholds(max_kl=0.5)) == []
    broken = requested_violations(
        FIGURES, 0.85, QualityThresholds(max_kl=0.1, min_top1=0.9, min_decided_top1=0.9)
    )
    assert broken == [
        "mean KL 0.30000 > 0.1 (max_kl)",
        "top-1 agreement 0.8000 < 0.9 (min_top1)",
        "top-1 agreement on decided positions 0.8500 < 0.9 (min_decided_top1)",
    ]
    # no decided position: the decided threshold has nothing to judge
    assert requested_violations(FIGURES, None, QualityThresholds(min_decided_top1=0.99)) == []


def test_the_default_fails_only_a_flip_of_decided_positions() -> None:
    margins = reference_margins(_logits(2.0), N_CTX, "q8_0", kl_mean=0.001)
    assert default_violation(0.95, margins) is None
    assert default_violation(None, margins) is None  # every position a near tie
    assert "0.5000 < 0.9 (14 of 14 positions" in str(default_violation(0.5, margins))


def test_verify_takes_true_false_or_an_object_of_thresholds() -> None:
    assert GGUFSpec(type="q8_0").thresholds is None
    spec = GGUFSpec.model_validate({"type": "q8_0", "verify": {"max_kl": 0.05}})
    assert spec.verify and spec.thresholds == QualityThresholds(max_kl=0.05)
    assert spec.model_dump(mode="json")["verify"]["max_kl"] == 0.05
    assert not GGUFSpec(type="q8_0", verify=False).verify
    with pytest.raises(ValidationError, match="at least one"):
        GGUFSpec.model_validate({"type": "q8_0", "verify": {}})
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"type": "q8_0", "verify": {"min_top1": 1.5}})
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"type": "q8_0", "verify": {"max_kll": 0.1}})


def test_excluded_rows_put_the_references_least_likely_token_first(tmp_path: Path) -> None:
    """What makes llama.cpp's "Same top p" count agreement on the kept positions only."""
    logits = _logits(2.0)
    chunks = chunk_tokens(np.arange(2 * N_CTX) % VOCAB, N_CTX)
    per_chunk = N_CTX // 2 - 1
    excluded = np.zeros(2 * per_chunk, dtype=bool)
    excluded[[0, per_chunk + 3]] = True
    write_llama_base_logits(tmp_path / "base", chunks, VOCAB, logits, excluded=excluded)
    _, decoded = _read_base(tmp_path / "base")
    tops = np.concatenate([d.argmax(axis=1) for d in decoded])
    least = np.concatenate([x[scored(N_CTX)].argmin(axis=1) for x in logits])
    assert (tops[excluded] == least[excluded]).all()
    assert (tops[~excluded] == 0).all()
