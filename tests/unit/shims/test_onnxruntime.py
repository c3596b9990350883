"""The assumption behind :mod:`service.shims.onnxruntime`: onnxruntime's private block kernels,
called on a slice of a weight's columns, write exactly the bytes its public quantizer
(``DefaultWeightOnlyQuantizer.qbits_block_quant``) writes for those columns of the whole."""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    DefaultWeightOnlyQuantizer,
)

from service.shims.onnxruntime import quantize_columns


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_sliced_kernel_calls_write_onnxruntime_quantizers_bytes(
    dtype: type, bits: int, block_size: int, symmetric: bool
) -> None:
    weight = np.random.default_rng(bits + block_size).standard_normal((200, 24)).astype(dtype)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    expected = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
    slices = [quantize_columns(weight[:, a : a + 7], bits, block_size, symmetric) for a in (0, 7, 14, 21)]
    for i, want in enumerate(expected):
        got = np.concatenate([s[i] for s in slices])
        assert got.dtype == want.dtype, "onnxruntime changed a quantized part's dtype"
        assert got.tobytes() == want.tobytes(), (
            "onnxruntime's quantize_matmul_{bits}bits no longer writes, slice by slice, what "
            "qbits_block_quant writes for the whole weight"
        )
