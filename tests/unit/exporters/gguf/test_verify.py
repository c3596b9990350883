"""The GGUF read-back (``service.exporters.gguf.verify``): its comparison of a decoded block with
its source rows (``block_error``), computed a cache-sized piece at a time, gives the same figures
as the formula over the whole block, and a single bad element anywhere (the last piece included)
fails it; its q8_0 decoder reads what gguf.quants reads, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from service.exporters.gguf.blocks import PIECE
from service.exporters.gguf.verify import _BLOCK_ABS, _BLOCK_REL, _FLOAT_REL, block_error
from tests.unit.exporters.gguf.test_writer import edge_rows

ROWS, COLS = 3 * PIECE // 2048 + 5, 2048
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


def test_the_torch_q8_0_decoder_reads_what_gguf_quants_reads() -> None:
    import torch

    from service.exporters.gguf.verify import _dequantize_q8_0

    encoded = quants.quantize(edge_rows(), GGMLQuantizationType.Q8_0)
    want = quants.dequantize(encoded, GGMLQuantizationType.Q8_0).reshape(-1)
    got = torch.empty(want.size, dtype=torch.float32)
    _dequantize_q8_0(torch.from_numpy(encoded.reshape(-1).copy()), got)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # bit for bit
