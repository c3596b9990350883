"""One dtype spelling and one zero-copy byte view for every writer."""

from __future__ import annotations

import pytest
import torch

from service.tensors import dtype_name, tensor_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_tensor_bytes_are_the_storage_bytes_for_dtypes_numpy_lacks(dtype: torch.dtype) -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
    raw = tensor_bytes(tensor)
    assert raw.format == "B" and raw.nbytes == tensor.numel() * tensor.element_size()
    back = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(3, 4)
    assert torch.equal(back, tensor)


def test_a_transposed_tensor_is_written_in_row_major_order() -> None:
    tensor = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()
    back = torch.frombuffer(bytearray(tensor_bytes(tensor)), dtype=torch.int32).reshape(3, 2)
    assert torch.equal(back, tensor)


def test_a_contiguous_tensor_is_viewed_not_copied() -> None:
    tensor = torch.zeros(4, dtype=torch.float32)
    raw = tensor_bytes(tensor)
    tensor[0] = 1.0
    assert bytes(raw[:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_dtype_names_have_no_torch_prefix_and_names_pass_through() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("q8_0") == "q8_0"
