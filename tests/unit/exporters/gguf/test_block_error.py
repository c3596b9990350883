"""The read-back's comparison of a decoded block with its source rows (``stream.block_error``),
computed a cache-sized piece at a time: the same figures as the formula over the whole block,
and a single bad element anywhere (the last piece included) fails it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from service.exporters.gguf.stream import _BLOCK_ABS, _BLOCK_REL, _FLOAT_REL, _PIECE, block_error

ROWS, COLS = 3 * _PIECE // 2048 + 5, 2048
"""A block of more than three pieces, the last one partial."""


def _stored(src: np.ndarray, type_name: str) -> np.ndarray:
    qtype = GGMLQuantizationType[type_name.upper()]
    return np.asarray(quants.dequantize(quants.quantize(src, qtype), qtype), dtype=np.float32)


def _whole(src: np.ndarray, got: np.ndarray, type_name: str) -> tuple[float, float]:
    """The bound over the whole block at once, as the docstrings of the bounds state it."""
    err = np.abs(got.astype(np.float64) - src)
    if type_name in _FLOAT_REL:
        bound = np.abs(src) * (_FLOAT_REL[type_name] * 1.001) + 1e-30
        bound += 2.0**-25 if type_name == "f16" else 0.0
        return float(err.max()), float((err / bound).max())
    amax = np.abs(src).reshape(-1, 32).max(axis=1)
    per_block = amax * (_BLOCK_REL[type_name] * 1.001) + _BLOCK_ABS[type_name]
    return float(err.max()), float((err.reshape(-1, 32).max(axis=1) / per_block).max())


@pytest.mark.parametrize("type_name", ["f16", "bf16", "q8_0", "q4_0"])
def test_pieces_give_the_whole_block_figures_and_a_bad_last_element_fails(type_name: str) -> None:
    rng = np.random.default_rng(0)
    src = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    src *= rng.choice(np.array([1e-6, 1.0, 1e3], dtype=np.float32), size=(ROWS, 1))
    got = _stored(src, type_name)
    worst, fraction = block_error(src, got.copy(), type_name)
    want_worst, want_fraction = _whole(src, got, type_name)
    assert worst == pytest.approx(want_worst, rel=1e-6)
    assert fraction == pytest.approx(want_fraction, rel=1e-5) and fraction <= 1.0
    bad = got.copy()
    bad[-1, -1] += 0.5 + abs(float(src[-1, -1]))
    assert block_error(src, bad, type_name)[1] > 1.0
    nan = got.copy()
    nan[ROWS // 2, 7] = np.nan
    assert not block_error(src, nan, type_name)[1] <= 1.0
