"""The q4_0 archive's exact check and quality report (``exporters.nnef.exact``) on logits
written as the job's independent reference writes them; the real tract run is in
``tests/integration/real_models/test_checks_fail.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from service.errors import QualityBelowThreshold, VerificationFailed
from service.exporters.nnef.exact import exact_tolerance, judge_compressed
from service.exporters.nnef.exporter import NNEFSpec
from service.verification.independent import IndependentReference
from service.verification.logits import scored
from service.verification.thresholds import QualityThresholds

N_CTX, VOCAB = 16, 32


def _reference(tmp_path: Path, logits: np.ndarray) -> IndependentReference:
    """A reference of 2 chunks whose logits are ``logits`` ``(2, N_CTX, VOCAB)``, stored as
    ``independent_reference`` stores them."""
    chunks = np.arange(2 * N_CTX, dtype=np.int32).reshape(2, N_CTX) % VOCAB
    for i, chunk in enumerate(logits):
        np.save(tmp_path / f"chunk-{i}.npy", chunk.astype(np.float32))
    return IndependentReference("transformers", "5", "whole", None, chunks, tmp_path, VOCAB)


def _logits(seed: int, scale: float = 4.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((2, N_CTX, VOCAB)) * scale).astype(
        np.float32
    )


def test_an_archive_equal_to_its_own_weights_run_passes_with_its_quality_reported(
    tmp_path: Path,
) -> None:
    source = _logits(0)
    lossy = source + _logits(1, 0.3)  # the compressed model: not the source, but the archive's
    window = scored(N_CTX)
    own = lossy[:, window]
    found = own + np.float32(1e-5)  # float32 accumulation noise
    report = judge_compressed(found, own, _reference(tmp_path, source), "q4_0", None, str)
    assert report["exact"]["max_abs_error"] <= report["exact"]["tolerance"]
    assert report["exact"]["tolerance_of"]["dtype"] == "float32"
    assert report["kl_mean"] > 0 and report["positions"] == 2 * (window.stop - window.start)
    assert report["margins"]["decided_positions"] + report["margins"]["near_tie_positions"] == (
        report["positions"]
    )
    assert report["thresholds"] is None


def test_one_position_beyond_float32s_tolerance_fails_saying_where(tmp_path: Path) -> None:
    source = _logits(0)
    own = source[:, scored(N_CTX)]
    found = own.copy()
    bound = exact_tolerance().bound(float(np.abs(own).max()))
    found[1, 3, 7] += 2 * bound
    with pytest.raises(VerificationFailed, match="archive's own q4_0 weights.*; at layers.0"):
        judge_compressed(found, own, _reference(tmp_path, source), "q4_0", None,
                         lambda: "at layers.0")  # fmt: skip


def test_a_requested_threshold_the_archive_misses_fails_quality_below_threshold(
    tmp_path: Path,
) -> None:
    source = _logits(0)
    own = (source + _logits(1, 2.0))[:, scored(N_CTX)]
    reference = _reference(tmp_path, source)
    met = judge_compressed(own, own, reference, "q4_0", QualityThresholds(max_kl=100.0), str)
    assert met["thresholds"] == {"max_kl": 100.0}
    with pytest.raises(QualityBelowThreshold, match=r"mean KL .* \(max_kl\)") as failed:
        judge_compressed(own, own, reference, "q4_0",
                         QualityThresholds(max_kl=met["kl_mean"] / 2), str)  # fmt: skip
    assert failed.value.code == "quality_below_threshold"


def test_nnef_quality_thresholds_need_a_compression() -> None:
    spec = NNEFSpec(compression="q4_0", verify={"min_decided_top1": 0.9})  # type: ignore[arg-type]
    assert spec.thresholds == QualityThresholds(min_decided_top1=0.9)
    assert NNEFSpec().thresholds is None
    with pytest.raises(ValidationError, match="compressed archive"):
        NNEFSpec(verify={"max_kl": 0.1})  # type: ignore[arg-type]
