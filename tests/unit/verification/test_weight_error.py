"""A stored weight's relative RMS error against the source's, measured in pieces: the same
figure whatever the pieces on either side, and the faults it is bounded against far beyond."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.errors import VerificationFailed
from service.verification.weight_error import WEIGHT_ERROR_BOUND, WeightError, relative_error


def _pieces(a: np.ndarray, size: int) -> list[np.ndarray]:
    flat = a.reshape(-1)
    return [flat[i : i + size] for i in range(0, flat.size, size)]


@pytest.mark.parametrize("stored_piece,source_piece", [(7, 100), (100, 7), (13, 13), (999, 1)])
def test_the_error_is_the_whole_tensors_whatever_the_pieces(
    stored_piece: int, source_piece: int
) -> None:
    rng = np.random.default_rng(0)
    source = rng.standard_normal((30, 20)).astype(np.float32)
    stored = source + 0.1 * rng.standard_normal(source.shape).astype(np.float32)
    diff, ref = stored.astype(np.float64) - source, source.astype(np.float64)
    whole = float(np.linalg.norm(diff) / np.linalg.norm(ref))
    error = relative_error(iter(_pieces(stored, stored_piece)), iter(_pieces(source, source_piece)))
    assert error == pytest.approx(whole, rel=1e-9)


def test_rows_upside_down_are_beyond_the_bound_and_zeros_are_zero() -> None:
    source = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    flipped = relative_error(iter([source[::-1].copy()]), iter([source]))
    assert flipped > WEIGHT_ERROR_BOUND and flipped == pytest.approx(math.sqrt(2), rel=0.1)
    zeros = np.zeros(8, dtype=np.float32)
    assert relative_error(iter([zeros]), iter([zeros])) == 0.0


def test_more_stored_values_than_the_source_holds_fail() -> None:
    error = WeightError(iter([np.ones(4, dtype=np.float32)]))
    with pytest.raises(VerificationFailed, match="more values than the source"):
        error.add(np.ones(5, dtype=np.float32))
