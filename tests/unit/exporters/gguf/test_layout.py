"""The GGUF layout's q/k permutation (``service.exporters.gguf.layout``), without llama.cpp's converter."""

from __future__ import annotations

import numpy as np

from service.exporters.gguf.layout import (
    permute_qk,
    unpermute_qk,
)


def test_permutation_is_llama_cpp_and_inverts() -> None:
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    permuted = permute_qk(rows, n_head=2)
    # Head 0 holds rows 0..7 as two halves [0..3] [4..7]; llama.cpp interleaves them.
    assert permuted[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert np.array_equal(unpermute_qk(permuted, 2), rows)
