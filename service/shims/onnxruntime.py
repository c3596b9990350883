"""onnxruntime's own block quantizer for ``MatMulNBits``, reached through its compiled module.

onnxruntime's public quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``,
``DefaultWeightOnlyQuantizer.qbits_block_quant``) takes a whole ``[K, N]`` weight and calls
``quantize_matmul_4bits`` / ``quantize_matmul_8bits`` from ``onnxruntime.capi._pybind_state``
(a private module) on it. Every quantization block lies within one column of ``[K, N]`` (one
row of a torch ``Linear`` weight), so the same kernels called on a slice of rows write exactly
the bytes the whole call writes for those rows: the export calls them slice by slice and never
holds a whole weight. Calling the kernels (rather than re-deriving their rounding in numpy) is
what makes the packed blocks onnxruntime's own, byte for byte
(``tests/unit/shims/test_onnxruntime.py`` compares with ``qbits_block_quant``).

Assumptions, checked on onnxruntime 1.31.1 (capped ``<1.32`` in ``pyproject.toml``):
``quantize_matmul_{4,8}bits(packed, weight, scales, zero_points, block_size, N, K,
is_symmetric)`` with ``weight`` ``[K(padded to blocks), N]`` float32 or float16, ``packed``
``[N, k_blocks, block_size * bits / 8]`` uint8, ``scales`` ``[N, k_blocks]`` in the weight's
dtype, ``zero_points`` ``[N, ceil(k_blocks * bits / 8)]`` uint8.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def block_quantizer(bits: int) -> Any:
    """onnxruntime's kernel quantizing a ``[K, N]`` weight to ``bits`` (4 or 8) per element."""
    from onnxruntime.capi import _pybind_state

    name = f"quantize_matmul_{bits}bits"
    kernel = getattr(_pybind_state, name, None)
    if kernel is None:
        raise RuntimeError(f"onnxruntime no longer has _pybind_state.{name}: see {__name__}")
    return kernel


def quantize_columns(
    weight_kn: np.ndarray, bits: int, block_size: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed, scales, zero_points) of ``weight_kn`` ``[K, N]``, as ``qbits_block_quant``
    computes them (the same zero padding of ``K`` to whole blocks, the same kernel)."""
    rows, cols = weight_kn.shape
    k_blocks = (rows + block_size - 1) // block_size
    kpack = 8 // bits
    pad = k_blocks * block_size - rows
    if pad:
        weight_kn = np.pad(weight_kn, ((0, pad), (0, 0)), "constant")
    weight_kn = np.ascontiguousarray(weight_kn)
    packed = np.zeros((cols, k_blocks, (block_size + kpack - 1) // kpack), dtype=np.uint8)
    zero_points = np.zeros((cols, (k_blocks + kpack - 1) // kpack), dtype=np.uint8)
    scales = np.zeros((cols, k_blocks), dtype=weight_kn.dtype)
    block_quantizer(bits)(packed, weight_kn, scales, zero_points, block_size, cols, rows, symmetric)
    return packed, scales, zero_points
