"""StoreTensor: a tensor to module code, read from disk on each use, quantized or not."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from service.offload.quant import dequantize, packed_nbytes, quantize
from service.offload.store import OffloadStore
from service.offload.tensor import StoreTensor


@pytest.fixture
def store(tmp_path: Path) -> OffloadStore:
    return OffloadStore(tmp_path / "s")


def test_linear_over_offloaded_weights_equals_in_memory(store: OffloadStore) -> None:
    weight, bias, x = torch.randn(8, 4), torch.randn(8), torch.randn(3, 4)
    store.put_tensor("w", weight)
    store.put_tensor("b", bias)
    w = StoreTensor.from_store(store, "w", torch.float32)
    b = StoreTensor.from_store(store, "b", torch.float32)
    assert torch.equal(F.linear(x, w, b), F.linear(x, weight, bias))
    assert (w.reloads, w.bytes_read, b.reloads) == (1, 8 * 4 * 4, 1)
    assert (store.reloads, store.bytes_read) == (2, 128 + 32)


def test_each_use_reloads_and_nothing_stays_resident(store: OffloadStore) -> None:
    weight = torch.randn(16, 16)
    store.put_tensor("w", weight)
    w = StoreTensor.from_store(store, "w", torch.float32)
    for _ in range(3):
        w @ torch.eye(16)
    assert w.reloads == 3
    assert w.bytes_read == 3 * weight.nbytes
    with pytest.raises(RuntimeError):
        w.untyped_storage().data_ptr()  # no storage: the data is only on disk


def test_module_code_sees_a_normal_tensor(store: OffloadStore) -> None:
    embedding = nn.Embedding(10, 4)
    table = embedding.weight.detach().clone()
    store.put_tensor("e", table)
    embedding._parameters["weight"] = StoreTensor.from_store(store, "e", torch.float32)  # type: ignore[assignment]
    ids = torch.tensor([[1, 7, 3]])
    assert torch.equal(embedding(ids), F.embedding(ids, table))
    w = embedding.weight
    assert (w.shape, w.dtype, w.device.type, w.is_meta) == (
        table.shape,
        torch.float32,
        "cpu",
        False,
    )
    state = embedding.state_dict()["weight"]
    assert isinstance(state, StoreTensor) and state.key == "e"


def test_dtype_is_cast_on_load_not_on_disk(store: OffloadStore) -> None:
    half = torch.randn(4, 4).to(torch.bfloat16)
    store.put_tensor("h", half)
    as_f32 = StoreTensor.from_store(store, "h", torch.float32)
    assert torch.equal(as_f32 + 0, half.float())
    assert store.entry("h").dtype == "bfloat16"


@pytest.mark.parametrize(("encoding", "max_err"), [("q8_0", 0.02), ("q4_0", 0.2)])
def test_quantized_weight_stays_packed_on_disk(
    store: OffloadStore, encoding: str, max_err: float
) -> None:
    weight = torch.randn(8, 64)
    store.put_quantized("q", weight, encoding)  # type: ignore[arg-type]
    entry = store.entry("q")
    assert entry.encoding == encoding
    assert entry.length == packed_nbytes((8, 64), encoding) < weight.nbytes
    q = StoreTensor.from_store(store, "q", torch.float32)
    out = q @ torch.eye(64)
    assert out.shape == weight.shape
    assert float((out - weight).abs().max()) < max_err * float(weight.abs().max())
    assert q.bytes_read == entry.length  # packed bytes are what comes back from disk


def test_q8_0_bytes_are_ggml_blocks_scale_then_int8() -> None:
    weight = torch.randn(4, 32)
    packed = quantize(weight, "q8_0")
    assert packed.numel() == 4 * (2 + 32)  # per row of 32: one f16 scale, 32 int8
    row = weight[0]
    scale = packed[:2].view(torch.float16).float()
    assert torch.allclose(scale, (row.abs().max() / 127).half().float())
    values = packed[2:34].view(torch.int8).float()
    assert torch.allclose(values * scale, row, atol=float(scale))
    assert torch.allclose(dequantize(packed, "q8_0", (4, 32))[0], values * scale)


def test_an_offloaded_tensor_cannot_be_pickled(store: OffloadStore) -> None:
    store.put_tensor("w", torch.ones(2))
    with pytest.raises(TypeError, match="handle"):
        pickle.dumps(StoreTensor.from_store(store, "w", torch.float32))


def test_writing_into_an_offloaded_tensor_is_refused_not_lost(store: OffloadStore) -> None:
    store.put_tensor("w", torch.ones(4))
    w = StoreTensor.from_store(store, "w", torch.float32)
    with pytest.raises(TypeError, match="read-only"):
        w.mul_(2)
    with pytest.raises(TypeError, match="read-only"):
        w.copy_(torch.zeros(4))
    assert torch.equal(w + 0, torch.ones(4))
    out = torch.empty(4)
    torch.add(w, 1, out=out)  # writing *from* it is fine
    assert torch.equal(out, torch.full((4,), 2.0))
