"""GGML block quantization (q8_0, q4_0) of offloaded weights, bytes identical to GGUF's.

A quantized weight stays offloaded: the store keeps only the packed blocks, and every reload
dequantizes them. The packing is gguf-py's reference implementation, so a GGUF export can reuse
these bytes and verification sees exactly what llama.cpp will.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from service.errors import InvalidRequest

QuantEncoding = Literal["q8_0", "q4_0"]

_TYPES: dict[str, GGMLQuantizationType] = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}


def _qtype(encoding: str) -> GGMLQuantizationType:
    try:
        return _TYPES[encoding]
    except KeyError:
        raise InvalidRequest(f"unknown quantization {encoding!r}; use q8_0 or q4_0") from None


def packed_nbytes(shape: tuple[int, ...], encoding: str) -> int:
    """Bytes of the GGML blocks of a float tensor of ``shape``."""
    block, size = GGML_QUANT_SIZES[_qtype(encoding)]
    if not shape or shape[-1] % block:
        raise InvalidRequest(f"last dimension of {list(shape)} is not a multiple of {block}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // block) * size


def quantize(tensor: torch.Tensor, encoding: str) -> torch.Tensor:
    """The packed GGML blocks of ``tensor`` (any float dtype) as a flat uint8 tensor."""
    packed_nbytes(tuple(tensor.shape), encoding)  # validates the shape
    data = tensor.detach().to(torch.float32).contiguous().numpy()
    packed = gguf_quantize(data, _qtype(encoding))
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1).view(np.uint8))


def dequantize(packed: torch.Tensor, encoding: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of ``shape`` that the packed blocks encode."""
    expected = packed_nbytes(shape, encoding)
    if packed.numel() != expected:
        raise InvalidRequest(f"{packed.numel()} packed bytes, {list(shape)} needs {expected}")
    rows = packed.numpy().reshape(-1, expected // max(1, _rows(shape)))
    values = gguf_dequantize(rows, _qtype(encoding))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows
