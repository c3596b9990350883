"""Run a dispatched model with its offloaded weights paged in module by module.

As accelerate's hooks do: just before a module's forward, its own offloaded tensors are read
from the store into plain tensors; right after, they are dropped again. At any time RAM holds
the ``"cpu"`` part of the model, the weights of the one module running, and activations, so a
model larger than RAM runs. Weights touched outside their module's forward still work: an
:class:`StoreTensor` loads itself for the op that needs it.

Two leaves are paged finer, because their weights can be huge (a 128k-token vocabulary at
8192 wide is 4 GiB in float32): an ``nn.Linear`` whose weight exceeds ``page_bytes`` runs in
slices of output rows of at most ``page_bytes``, and an ``nn.Embedding`` reads only the rows of
the token ids it is given. The working set is then bounded by ``page_bytes``, not by the
largest tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from service.offload.tensor import StoreTensor

PAGE_BYTES = 64 << 20
"""Largest slice of one weight paged in at once by the sliced Linear / gathered Embedding."""


@dataclass
class StreamStats:
    """What a streamed run paged in."""

    modules_paged: int = 0
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    peak_resident_bytes: int = 0
    """Largest amount of paged-in weight bytes held at once."""


class _Pager:
    def __init__(self, stats: StreamStats, check_abort: Callable[[], None] | None = None) -> None:
        self.stats = stats
        self.check_abort = check_abort
        self.swapped: dict[int, tuple[nn.Module, dict[str, torch.Tensor], int]] = {}
        self.resident = 0

    def page_in(self, module: nn.Module, args: Any) -> None:
        if self.check_abort is not None:
            self.check_abort()  # a long forward stays cancellable, module by module
        originals: dict[str, torch.Tensor] = {}
        nbytes = 0
        for attr, value in module._parameters.items():
            if isinstance(value, StoreTensor):
                loaded = value.materialize()
                originals[attr] = value
                module._parameters[attr] = loaded
                nbytes += loaded.nbytes
        if not originals:
            return
        self.swapped[id(module)] = (module, originals, nbytes)
        self.resident += nbytes
        self.stats.modules_paged += 1
        self.stats.tensors_loaded += len(originals)
        self.stats.bytes_loaded += nbytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.resident)

    def page_out(self, module: nn.Module, args: Any = None, output: Any = None) -> None:
        entry = self.swapped.pop(id(module), None)
        if entry is None:
            return
        _, originals, nbytes = entry
        for attr, value in originals.items():
            module._parameters[attr] = value  # type: ignore[assignment]
        self.resident -= nbytes

    def page_out_all(self) -> None:
        for module, _, _ in list(self.swapped.values()):
            self.page_out(module)


def offloaded_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that directly own at least one offloaded parameter."""
    return [
        m
        for m in model.modules()
        if any(isinstance(p, StoreTensor) for p in m._parameters.values())
    ]


def _sliceable(module: nn.Module, page_bytes: int) -> bool:
    """A plain Linear/Embedding (forward not overridden) whose weight is worth slicing."""
    weight = module._parameters.get("weight")
    if not isinstance(weight, StoreTensor) or weight.nbytes <= page_bytes:
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    return type(module).forward is nn.Embedding.forward and getattr(module, "max_norm", 1) is None


def paging_bytes(module: nn.Module, dtype: torch.dtype | None, page_bytes: int = PAGE_BYTES) -> int:
    """Weight bytes held at once while this module runs streamed (works on meta modules)."""
    own = 0
    for param in module._parameters.values():
        if param is not None:
            itemsize = dtype.itemsize if dtype and param.dtype.is_floating_point else None
            own += param.numel() * (itemsize or param.dtype.itemsize)
    if own <= page_bytes:
        return own
    if type(module).forward is nn.Embedding.forward:
        return page_bytes  # a few rows in practice; a page is a safe bound
    if type(module).forward is nn.Linear.forward:
        return max(page_bytes, own // max(1, getattr(module, "out_features", 1)))  # >= a row
    return own


class _Sliced:
    """Forwards for huge offloaded Linear/Embedding weights, reading them slice by slice."""

    def __init__(self, module: nn.Module, pager: _Pager, page_bytes: int) -> None:
        self.module = module
        self.pager = pager
        self.page_bytes = page_bytes
        weight = module._parameters["weight"]
        assert isinstance(weight, StoreTensor)
        self.weight: StoreTensor = weight

    def _account(self, loaded: torch.Tensor, first: bool) -> None:
        stats = self.pager.stats
        if first:
            self.weight.reloads += 1
            stats.tensors_loaded += 1
            stats.modules_paged += 1
        stats.bytes_loaded += loaded.nbytes
        stats.peak_resident_bytes = max(
            stats.peak_resident_bytes, self.pager.resident + loaded.nbytes
        )

    def _rows(self, start: int, stop: int, first: bool) -> torch.Tensor:
        if first and self.pager.check_abort is not None:
            self.pager.check_abort()
        w = self.weight
        before = w.store.bytes_read
        rows: torch.Tensor = w.store.load_rows(w.key, start, stop, w.dtype, count_reload=first)
        w.bytes_read += w.store.bytes_read - before
        self._account(rows, first)
        return rows

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        bias = self.module._parameters.get("bias")
        if isinstance(bias, StoreTensor):
            bias = bias.materialize()
            self.pager.stats.tensors_loaded += 1
            self.pager.stats.bytes_loaded += bias.nbytes
        out_features, in_features = w.shape
        step = max(1, self.page_bytes // max(1, in_features * w.dtype.itemsize))
        pieces = []
        for start in range(0, out_features, step):
            stop = min(out_features, start + step)
            rows = self._rows(start, stop, first=start == 0)
            pieces.append(F.linear(x, rows, None if bias is None else bias[start:stop]))
            del rows
        return torch.cat(pieces, dim=-1)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        values = unique.tolist()
        if values and (values[0] < 0 or values[-1] >= self.weight.shape[0]):
            raise IndexError("index out of range in self")
        tables: list[torch.Tensor] = []
        i = 0
        while i < len(values):  # one read per run of consecutive ids
            j = i
            while j + 1 < len(values) and values[j + 1] == values[j] + 1:
                j += 1
            tables.append(self._rows(values[i], values[j] + 1, first=i == 0))
            i = j + 1
        table = torch.cat(tables) if tables else self.weight.new_empty((0, self.weight.shape[1]))
        return F.embedding(inverse, table)


@contextmanager
def streamed(
    model: nn.Module,
    page_bytes: int = PAGE_BYTES,
    check_abort: Callable[[], None] | None = None,
) -> Iterator[StreamStats]:
    """Within the block, calling ``model`` pages offloaded weights in and out per module;
    ``check_abort`` (e.g. ``ctx.check_abort``) runs before each module pages in."""
    stats = StreamStats()
    pager = _Pager(stats, check_abort)
    handles: list[RemovableHandle] = []
    patched: list[nn.Module] = []
    try:
        for module in offloaded_modules(model):
            if _sliceable(module, page_bytes):
                sliced = _Sliced(module, pager, page_bytes)
                is_linear = type(module).forward is nn.Linear.forward
                module.forward = sliced.linear if is_linear else sliced.embedding
                patched.append(module)
                continue
            handles.append(module.register_forward_pre_hook(pager.page_in))
            handles.append(module.register_forward_hook(pager.page_out))
        yield stats
    finally:
        for handle in handles:
            handle.remove()
        for module in patched:
            del module.forward
        pager.page_out_all()  # a forward that raised leaves modules paged in


def model_output(output: Any) -> torch.Tensor:
    """The tensor to compare across runs: logits when there are, else the last hidden state."""
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find an output tensor in {type(output).__name__}")


def streamed_forward(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    page_bytes: int = PAGE_BYTES,
    check_abort: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, StreamStats]:
    """One forward pass with weights streamed from the store; returns (output tensor, stats)."""
    kwargs: dict[str, Any] = dict(inputs)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    with torch.inference_mode(), streamed(model, page_bytes, check_abort) as stats:
        output = model(**kwargs)
    return model_output(output).clone(), stats
