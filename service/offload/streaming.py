"""Run a dispatched model with its offloaded weights paged in module by module.

As accelerate's hooks do: just before a module's forward, its own offloaded tensors are read
from the store into plain tensors; right after, they are dropped again. At any time RAM holds
the ``"cpu"`` part of the model, the weights of the one module running, and activations, so a
model larger than RAM runs. Weights touched outside their module's forward still work: an
:class:`OffloadedTensor` loads itself for the op that needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from service.offload.tensor import OffloadedTensor


@dataclass
class StreamStats:
    """What a streamed run paged in."""

    modules_paged: int = 0
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    peak_resident_bytes: int = 0
    """Largest amount of paged-in weight bytes held at once."""


class _Pager:
    def __init__(self, stats: StreamStats) -> None:
        self.stats = stats
        self.swapped: dict[int, tuple[nn.Module, dict[str, torch.Tensor], int]] = {}
        self.resident = 0

    def page_in(self, module: nn.Module, args: Any) -> None:
        originals: dict[str, torch.Tensor] = {}
        nbytes = 0
        for attr, value in module._parameters.items():
            if isinstance(value, OffloadedTensor):
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
        if any(isinstance(p, OffloadedTensor) for p in m._parameters.values())
    ]


@contextmanager
def streamed(model: nn.Module) -> Iterator[StreamStats]:
    """Within the block, calling ``model`` pages offloaded weights in and out per module."""
    stats = StreamStats()
    pager = _Pager(stats)
    handles: list[RemovableHandle] = []
    try:
        for module in offloaded_modules(model):
            handles.append(module.register_forward_pre_hook(pager.page_in))
            handles.append(module.register_forward_hook(pager.page_out))
        yield stats
    finally:
        for handle in handles:
            handle.remove()
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
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, StreamStats]:
    """One forward pass with weights streamed from the store; returns (output tensor, stats)."""
    kwargs: dict[str, Any] = dict(inputs)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    with torch.inference_mode(), streamed(model) as stats:
        output = model(**kwargs)
    return model_output(output).clone(), stats
