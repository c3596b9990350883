"""An ONNX export's weights a block of bounded bytes at a time: written, and run by PyTorch.

No term of the ONNX job is a whole tensor. The external data file is written a block at a
time (:func:`weight_blocks`: read, cast, written, dropped), and PyTorch's side of the check
(:mod:`service.exporters.onnx.verify`: the offloaded model's greedy decode) runs each plain
``nn.Linear`` a block of output rows at a time and each plain ``nn.Embedding`` on the rows of
its token ids alone, read from the job's offload store (:func:`weights_in_blocks`), where
reloading the weight would hold it whole, and a second time when cast (a 70B embedding is
2 GiB in bfloat16 and 4 GiB as float32).

A block is at most ``WRITE_BLOCK_BYTES`` (the plan's figure, :data:`service.exporters.onnx.plan.
WRITE_BLOCK_BYTES`, read from this module at each call: a test sets a tiny block here) in the
wider of the stored and exported dtypes, whole rows when the offload store holds the weight. The job holds the block as read and its
cast: ``plan.WRITE_BLOCK_COPIES`` blocks, whatever the width (the plan's write term).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from service.exporters.onnx import plan

if TYPE_CHECKING:
    import torch
    from torch import nn

WRITE_BLOCK_BYTES = plan.WRITE_BLOCK_BYTES
"""The most bytes of a weight held at once, written or multiplied (the plan's figure)."""


def in_store(source: Any) -> tuple[Any, str] | None:
    """(store, name) when ``source`` is an offloaded weight read from the job's offload store."""
    from service.shims.torch_to_nnef import CheckpointTensor

    if not isinstance(source, CheckpointTensor) or source.source is None:
        return None
    store = getattr(source.reader, "store", None)  # the offloaded model's store-backed reader
    if store is None or source.source not in store:
        return None
    return store, source.source


def _row_step(store: Any, name: str, target: torch.dtype, block_bytes: int) -> int:
    """Rows of ``name`` per block: at most ``block_bytes`` in the wider dtype, one at least."""
    entry = store.entry(name)
    row = math.prod(tuple(entry.shape)[1:]) * max(target.itemsize, entry.torch_dtype.itemsize)
    return max(1, block_bytes // max(1, int(row)))


def weight_blocks(
    source: Any, target: torch.dtype, block_bytes: int
) -> Iterator[torch.Tensor] | None:
    """``source``'s elements in C order, cast to ``target``, in contiguous blocks of at most
    ``block_bytes`` in the wider of the two dtypes; None when it can only be read whole (a
    weight torch-to-nnef rewrote). Cast element by element, so the bytes do not depend on the
    block: a weight the offload store holds is read in whole rows (``load_rows``, which also
    decodes q8_0/q4_0 entries), one the checkpoint reader serves in flat pieces
    (``iter_chunks``), a tensor in RAM (a computed buffer, a weight the job kept) sliced."""
    import torch

    from service.shims.torch_to_nnef import CheckpointTensor

    hook = getattr(source, "hook", None)
    stored = in_store(source)
    if stored is not None:
        store, name = stored
        shape = tuple(store.entry(name).shape)

        def from_store() -> Iterator[torch.Tensor]:
            if not shape:
                yield store.load(name, dtype=target).contiguous()
                return
            step = _row_step(store, name, target, block_bytes)
            for start in range(0, shape[0], step):
                part = store.load_rows(name, start, min(shape[0], start + step), dtype=target)
                if hook is not None:
                    hook(part.nbytes)
                yield part.contiguous()

        return from_store()
    if isinstance(source, CheckpointTensor):
        chunks = getattr(source.reader, "iter_chunks", None)
        stored_dtype = _stored_dtype(source) if source.source is not None else None
        if chunks is None or stored_dtype is None:
            return None
        elements = max(1, block_bytes // max(target.itemsize, stored_dtype.itemsize))

        def from_reader() -> Iterator[torch.Tensor]:
            for piece in chunks(source.source, elements * stored_dtype.itemsize):
                if hook is not None:
                    hook(piece.nbytes)
                yield piece.to(target).contiguous()

        return from_reader()
    flat = source.detach().as_subclass(torch.Tensor).reshape(-1)
    elements = max(1, block_bytes // max(target.itemsize, flat.element_size()))
    return (
        flat[i : i + elements].to(target).contiguous() for i in range(0, flat.numel(), elements)
    )


def _stored_dtype(source: Any) -> torch.dtype | None:
    """The dtype the checkpoint reader stores ``source``'s weight in (None: unknown)."""
    infos = getattr(source.reader, "tensor_infos", None)
    if infos is None:
        return None
    for info in infos():
        if info.name == source.source:
            dtype: torch.dtype = info.dtype
            return dtype
    return None


@contextlib.contextmanager
def weights_in_blocks(module: nn.Module, block_bytes: int | None = None) -> Iterator[int]:
    """While inside, every plain ``nn.Linear`` and ``nn.Embedding`` of the offloaded ``module``
    whose weight the offload store holds reads it from there a block at a time instead of
    reloading it whole: a Linear's outputs a block of rows of its weight at a time (``x W^T``
    by row blocks of ``W``: each output element is the same dot product), an Embedding's rows of
    the token ids it is given. A module whose ``forward`` is already replaced (a quantized
    layer run on the artifact's weight) is left alone. Yields how many modules were replaced."""
    from torch import nn

    patched: list[nn.Module] = []
    try:
        for layer in module.modules():
            if "forward" in vars(layer) or type(layer) not in (nn.Linear, nn.Embedding):
                continue
            if isinstance(layer, nn.Embedding) and layer.max_norm is not None:
                continue  # renormalizes the rows it reads: transformers' own forward
            stored = in_store(layer.weight)
            if stored is None:
                continue
            weight: Any = layer.weight
            target: torch.dtype = weight.elem.dtype  # the shell's: no reload
            if type(layer) is nn.Linear:
                forward = _linear_in_blocks(layer, *stored, target, block_bytes)
            else:
                forward = _embedding_rows(*stored, target)
            layer.forward = forward
            patched.append(layer)
        yield len(patched)
    finally:
        for layer in patched:
            del layer.forward


def _linear_in_blocks(
    layer: nn.Linear, store: Any, name: str, target: torch.dtype, block_bytes: int | None
) -> Any:
    import torch

    from service.shims.torch_to_nnef import CheckpointTensor

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = x.as_subclass(torch.Tensor)
        stored_bias: Any = layer.bias
        if isinstance(stored_bias, CheckpointTensor):
            stored_bias = stored_bias.reload()
        bias = None if stored_bias is None else stored_bias.as_subclass(torch.Tensor)
        rows = layer.out_features
        step = _row_step(store, name, target, block_bytes or WRITE_BLOCK_BYTES)
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            w = store.load_rows(name, start, stop, dtype=target)
            b = None if bias is None else bias[start:stop]
            out[..., start:stop] = torch.nn.functional.linear(x, w, b)
            del w
        return out

    return forward


def _embedding_rows(store: Any, name: str, target: torch.dtype) -> Any:
    import torch

    def forward(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.as_subclass(torch.Tensor)
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = torch.cat([store.load_rows(name, i, i + 1, dtype=target) for i in unique.tolist()])
        return rows[inverse].reshape(*ids.shape, rows.shape[-1])

    return forward
