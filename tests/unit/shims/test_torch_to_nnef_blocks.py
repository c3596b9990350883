"""service.shims.torch_to_nnef reading a weight in blocks: the NNEF writer's ``.dat`` files,
a forward's ``embedding`` and ``linear``, the trace's embedding and its dtype questions. Each
gives what torch-to-nnef's whole reload gives (the same bytes, the same values) and never reads
the weight whole; a failure names the torch-to-nnef or nnef assumption that broke."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.shims import torch_to_nnef as t2n


class _Weights:
    """A tensor source as the checkpoint readers and the offload store are: ``read`` whole,
    ``iter_chunks`` flattened pieces of at most ``max_bytes`` stored bytes, both recorded."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.whole: list[str] = []
        self.pieces: list[int] = []

    def read(self, name: str) -> torch.Tensor:
        self.whole.append(name)
        return self.tensors[name].clone()

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        flat = self.tensors[name].reshape(-1)
        step = max(1, max_bytes // flat.element_size())
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step].clone()
            self.pieces.append(piece.nbytes)
            yield piece


def _tensor(
    weights: _Weights, name: str, dtype: torch.dtype, tmp: Path, block: int | None = 96
) -> t2n.CheckpointTensor:
    stored = weights.tensors[name]
    tensor = t2n.CheckpointTensor.create(weights, name, name, tuple(stored.shape), dtype, tmp)
    tensor.block_bytes = block
    return tensor


def _whole_dat(value: torch.Tensor, path: Path) -> bytes:
    """What torch-to-nnef's writer writes for a reloaded value (``write_nnef_tensor`` of
    ``np.asarray(maybe_torch_to_np(value), order="C")``, that is ``nnef.write_tensor``)."""
    from torch_to_nnef.nnef_io import writer

    array = np.asarray(writer.maybe_torch_to_np(value), order="C")
    writer.write_nnef_tensor(array, str(path), quantized=False)
    return path.read_bytes()


CASES = {
    "float32 rows a block does not divide": (torch.randn(7, 5), torch.float32),
    "float32 cast to float16": (torch.randn(6, 4), torch.float16),
    "bfloat16 cast to float32": (torch.randn(9, 3).bfloat16(), torch.float32),
    "float16 three dimensions": (torch.randn(3, 4, 5).half(), torch.float16),
    "int64 one dimension": (torch.arange(50), torch.int64),
    "float32 scalar-like": (torch.randn(1), torch.float32),
}


@pytest.mark.parametrize("case", CASES)
def test_a_dat_written_in_blocks_is_the_bytes_torch_to_nnef_writes_whole(
    case: str, tmp_path: Path
) -> None:
    stored, dtype = CASES[case]
    weights = _Weights({"w": stored})
    tensor = _tensor(weights, "w", dtype, tmp_path)
    t2n.write_dat_in_blocks(tensor, tmp_path / "w.dat", max_bytes=16)
    expected = _whole_dat(stored.to(dtype), tmp_path / "whole.dat")
    assert (tmp_path / "w.dat").read_bytes() == expected, (
        "assumption broken: nnef.write_tensor writes a 128-byte header (magic, version, length, "
        "rank, shape padded to MaxTensorRank, bits, item type, 19 reserved words) then the "
        "array's bytes in C order"
    )
    assert weights.whole == [] and max(weights.pieces) <= 16


def test_the_writer_hook_writes_a_checkpoint_tensor_in_blocks(tmp_path: Path) -> None:
    from torch_to_nnef.nnef_io import writer

    weights = _Weights({"w": torch.randn(40, 8)})
    tensor = _tensor(weights, "w", torch.float32, tmp_path)
    with t2n.checkpoint_tensors_writable():
        writer.write_offloaded_tensor(tensor, str(tmp_path / "w.dat"), False)
    whole = _whole_dat(weights.tensors["w"], tmp_path / "whole.dat")
    assert (tmp_path / "w.dat").read_bytes() == whole
    assert weights.whole == [], "the writer read the weight whole"
    assert max(weights.pieces) <= t2n.WRITE_BLOCK_BYTES


def test_a_forward_reads_a_weight_larger_than_the_block_a_block_of_rows_at_a_time(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    table, head, bias = torch.randn(50, 8).bfloat16(), torch.randn(30, 8), torch.randn(30)
    weights = _Weights({"embed": table, "head": head})
    embed = _tensor(weights, "embed", torch.float32, tmp_path, block=64)  # 4 rows of 16 bytes
    proj = _tensor(weights, "head", torch.float32, tmp_path, block=100)  # rows straddle blocks
    ids = torch.tensor([[0, 49, 3, 3, 17]])
    assert torch.equal(F.embedding(ids, embed), F.embedding(ids, table.float()))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(F.linear(x, proj, bias), F.linear(x, head, bias))
    torch.testing.assert_close(F.linear(x, proj), F.linear(x, head))
    assert weights.whole == [], "a forward read a weight larger than the block whole"
    assert max(weights.pieces) <= 100
    small = _tensor(weights, "head", torch.float32, tmp_path, block=None)
    torch.testing.assert_close(F.linear(x, small, bias), F.linear(x, head, bias))
    assert weights.whole == ["head"], (
        "assumption broken: OffloadedTensor.__torch_function__ reloads a weight whole for an op "
        "(a weight within the block keeps torch-to-nnef's path)"
    )


class _Model(torch.nn.Module):
    """Two embeddings as a transformers model holds them: the input one (its
    ``get_input_embeddings()``) and one of positions."""

    def __init__(self, words: torch.Tensor, positions: torch.Tensor) -> None:
        super().__init__()
        self.words, self.positions = torch.nn.Module(), torch.nn.Module()
        self.words._parameters["weight"] = words  # as torch-to-nnef's updater sets it
        self.positions._parameters["weight"] = positions

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.words


def test_the_traces_input_embedding_is_zero_pages_the_size_of_the_weight(tmp_path: Path) -> None:
    from torch_to_nnef.tensor.opaque import OpaqueTensor

    assert "_to_trace_tensor" in OpaqueTensor.__dict__, (
        "assumption broken: OpaqueTensor.to_trace_tensor(device) goes through "
        "_to_trace_tensor(device), which materializes the weight for device 'cpu' (embedding)"
    )
    weights = _Weights({"embed": torch.randn(50, 8)})
    embed = _tensor(weights, "embed", torch.float32, tmp_path, block=64)
    positions = _tensor(weights, "embed", torch.float32, tmp_path, block=64)
    t2n.read_in_blocks(_Model(embed, positions), 64)
    assert embed.looked_up_by_inputs and not positions.looked_up_by_inputs
    assert torch.equal(positions._to_trace_tensor("cpu"), weights.tensors["embed"])
    weights.whole.clear()
    traced = embed._to_trace_tensor("cpu")
    assert traced.shape == (50, 8) and traced.dtype == torch.float32
    assert not traced.any() and weights.whole == []
    embed.block_bytes = None  # within the block: torch-to-nnef's path, the real values
    assert torch.equal(embed._to_trace_tensor("cpu"), weights.tensors["embed"])


def test_dtype_questions_in_the_trace_are_answered_from_the_shell() -> None:
    from torch_to_nnef.tensor import opaque

    assert callable(opaque.__dict__.get("trace_tensor_device_for_func")), (
        "assumption broken: torch_to_nnef.tensor.opaque.trace_tensor_device_for_func(func) is "
        "the module global OpaqueTensorRef.__torch_function__ asks"
    )
    asked = opaque.trace_tensor_device_for_func
    assert asked(torch.Tensor.is_floating_point) is None, (
        "assumption changed: a wrapped weight's is_floating_point() expands it whole (if it no "
        "longer does, metadata_from_shells can go)"
    )
    with t2n.metadata_from_shells():
        for func in (torch.Tensor.is_floating_point, torch.Tensor.numel, torch.Tensor.size):
            assert opaque.trace_tensor_device_for_func(func) == "meta"
        assert opaque.trace_tensor_device_for_func(F.embedding) == "cpu"
    assert opaque.trace_tensor_device_for_func is asked
