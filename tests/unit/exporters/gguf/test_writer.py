"""The GGUF writer's encoders (``service.exporters.gguf.writer``): torch's bytes are gguf.quants'."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from service.exporters.gguf.writer import BlockEncoder


def edge_rows() -> np.ndarray:
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
    rows = edge_rows()
    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    encoder = BlockEncoder()
    want = gguf.quants.quantize(rows, qtype).tobytes()
    for slot in (0, 1):  # both output slots, the second reusing nothing of the first
        assert bytes(encoder.encode(rows, int(qtype), type_name, slot)) == want
    # a non-contiguous block (a permuted q/k view) encodes like its contiguous copy
    view = rows[:, ::-1]
    assert (
        bytes(encoder.encode(view, int(qtype), type_name))
        == gguf.quants.quantize(np.ascontiguousarray(view), qtype).tobytes()
    )
