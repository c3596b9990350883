"""Where each module's weights live: in RAM (``"cpu"``) or in the offload store (``"disk"``).

A device map is ``{module name: "cpu" | "disk"}``, as accelerate writes them; a tensor goes where
its longest listed module prefix says (``""`` covers the whole model). ``"auto"`` fills a RAM
budget front to back with whole modules (never splitting a ``no_split_module_classes`` module,
e.g. a decoder layer) and sends the rest to disk, using accelerate's planner.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from service.errors import InvalidRequest
from service.units import parse_size

Placement = Literal["cpu", "disk"]
DeviceMap = dict[str, Placement]

# accelerate wants a finite budget for every device; the disk is only bounded by the quota.
_UNBOUNDED = 1 << 62


def auto_device_map(
    model: nn.Module,
    max_memory: int | str,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | None = None,
) -> DeviceMap:
    """Fill ``max_memory`` bytes of RAM with whole modules in order, the rest on disk."""
    from accelerate import infer_auto_device_map

    budget = parse_size(max_memory)
    if no_split_module_classes is None:
        no_split_module_classes = sorted(getattr(model, "_no_split_modules", None) or [])
    planned = infer_auto_device_map(
        model,
        max_memory={"cpu": budget, "disk": _UNBOUNDED},
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
    )
    return {name: _placement(name, value) for name, value in planned.items()}


def validate_device_map(model: nn.Module, device_map: dict[str, str]) -> DeviceMap:
    """An explicit map, checked: known modules, known placements, every tensor covered."""
    modules = {name for name, _ in model.named_modules()}
    result: DeviceMap = {}
    for name, value in device_map.items():
        if name not in modules:
            raise InvalidRequest(f"device map names {name!r}, which is not a module of the model")
        result[name] = _placement(name, value)
    for tensor_name in _tensor_names(model):
        if placement_of(tensor_name, result) is None:
            raise InvalidRequest(f"device map leaves {tensor_name!r} without a placement")
    return result


def resolve_device_map(
    model: nn.Module,
    device_map: Literal["auto"] | dict[str, str] | None,
    max_memory: int | str,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | None = None,
) -> DeviceMap:
    """The one entry point: ``"auto"``/None plans within ``max_memory``, a dict is validated."""
    if device_map is None or device_map == "auto":
        return auto_device_map(model, max_memory, no_split_module_classes, dtype)
    if isinstance(device_map, dict):
        return validate_device_map(model, device_map)
    raise InvalidRequest(f"device_map must be 'auto' or a mapping, got {device_map!r}")


def placement_of(tensor_name: str, device_map: DeviceMap) -> Placement | None:
    """The placement of a tensor: that of its longest module prefix in the map."""
    name = tensor_name
    while True:
        if name in device_map:
            return device_map[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


def _placement(name: str, value: object) -> Placement:
    if value in ("cpu", "disk"):
        return value
    raise InvalidRequest(f"device map puts {name!r} on {value!r}; only 'cpu' and 'disk' exist")


def _tensor_names(model: nn.Module) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    names += [n for n, _ in model.named_buffers()]
    return names


def placed_bytes(model: nn.Module, device_map: DeviceMap, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of parameters per placement (what the map asks of RAM and of the disk)."""
    totals = {"cpu": 0, "disk": 0}
    for name, param in model.named_parameters():
        place = placement_of(name, device_map) or "cpu"
        itemsize = dtype.itemsize if param.dtype.is_floating_point else param.dtype.itemsize
        totals[place] += param.numel() * itemsize
    return totals
