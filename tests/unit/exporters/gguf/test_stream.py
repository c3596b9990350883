"""The GGUF writer's encoders (``service.exporters.gguf.stream``): torch's bytes are gguf.quants'."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest

from service.exporters.gguf.stream import RowBlockReader


class _NoReader:
    def tensor_infos(self) -> list[Any]:
        return []

    def aliases(self) -> dict[str, str]:
        return {}


def _edge_rows() -> np.ndarray:
    """Rows whose q8_0 blocks hit every rounding case: zeros, exact halves, subnormal scales."""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    rows[0, :32] = 0.0  # d == 0: id is 0, not inf
    rows[1, :32] = np.arange(32, dtype=np.float32) / 2 - 8  # x * id lands on .5
    rows[2, :32] = -127.5 / 127
    rows[3] *= np.float32(1e-30)  # the scale rounds to an f16 subnormal (or 0)
    rows[4] *= np.float32(1e4)
    rows[5, :32] = np.float32(1e-45)
    return rows


@pytest.mark.parametrize("type_name", ["f32", "f16", "q8_0"])
def test_torch_encoders_write_the_bytes_gguf_quants_writes(type_name: str) -> None:
    rows = _edge_rows()
    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    blocks = RowBlockReader(_NoReader())  # type: ignore[arg-type]
    want = gguf.quants.quantize(rows, qtype).tobytes()
    for slot in (0, 1):  # both output slots, the second reusing nothing of the first
        assert bytes(blocks.encode(rows, int(qtype), type_name, slot)) == want
    # a non-contiguous block (a permuted q/k view) encodes like its contiguous copy
    view = rows[:, ::-1]
    assert (
        bytes(blocks.encode(view, int(qtype), type_name))
        == gguf.quants.quantize(np.ascontiguousarray(view), qtype).tobytes()
    )


def test_the_torch_q8_0_decoder_reads_what_gguf_quants_reads() -> None:
    import torch

    from service.exporters.gguf.stream import _dequantize_q8_0

    encoded = gguf.quants.quantize(_edge_rows(), gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(encoded, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    got = torch.empty(want.size, dtype=torch.float32)
    _dequantize_q8_0(torch.from_numpy(encoded.reshape(-1).copy()), got)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # bit for bit
