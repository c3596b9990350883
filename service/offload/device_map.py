"""Where each module's weights live: in RAM (``"cpu"``) or in the offload store (``"disk"``).

A device map is ``{module name: "cpu" | "disk"}``, as accelerate writes them; a tensor goes where
its longest listed module prefix says (``""`` covers the whole model). ``"auto"`` fills a RAM
budget front to back with whole modules (never splitting a ``no_split_module_classes`` module,
e.g. a decoder layer) and sends the rest to disk.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from service.errors import InvalidRequest
from service.units import parse_size

Placement = Literal["cpu", "disk"]
DeviceMap = dict[str, Placement]


def auto_device_map(
    model: nn.Module,
    max_memory: int | str,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | None = None,
) -> DeviceMap:
    """Fill ``max_memory`` bytes of RAM with whole modules in order, the rest on disk.

    The budget covers everything the weights take in RAM while streaming: the ``"cpu"`` modules
    plus the most weight bytes paged in at once while streaming (one leaf, or one slice of a
    huge Linear/Embedding: :func:`service.offload.streaming.paging_bytes`), kept in reserve. accelerate's ``infer_auto_device_map`` reserves a whole no-split layer instead,
    as its hooks page per layer; ours page per leaf, so we plan with its
    ``compute_module_sizes`` and our own front-to-back fill.
    """
    from accelerate.utils import compute_module_sizes

    from service.offload.streaming import paging_bytes

    budget = parse_size(max_memory)
    if no_split_module_classes is None:
        no_split_module_classes = sorted(getattr(model, "_no_split_modules", None) or [])
    no_split = set(no_split_module_classes)
    sizes = compute_module_sizes(model, dtype=dtype)
    reserve = max((paging_bytes(m, dtype) for m in model.modules()), default=0)
    room = budget - reserve
    device_map: DeviceMap = {}
    queue: list[tuple[str, nn.Module]] = list(model.named_children())
    if _own_bytes(model, dtype):
        device_map[""] = "disk"  # root-level tensors (rare): stream them
    spilled = False
    while queue:
        name, module = queue.pop(0)
        size = sizes.get(name, 0)
        if not spilled and size <= room:
            device_map[name] = "cpu"
            room -= size
            continue
        children = list(module.named_children())
        if (
            spilled
            or not children
            or type(module).__name__ in no_split
            or _own_bytes(module, dtype)
        ):
            device_map[name] = "disk"
            spilled = True
            continue
        queue = [(f"{name}.{child}", sub) for child, sub in children] + queue
    if "" in device_map and all(v == "cpu" for k, v in device_map.items() if k):
        device_map[""] = "cpu"
    return device_map


def _own_bytes(module: nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes of the parameters a module holds directly (what one paging step loads)."""
    total = 0
    for param in module._parameters.values():
        if param is None:
            continue
        float_dtype = dtype if dtype is not None and param.dtype.is_floating_point else param.dtype
        total += param.numel() * float_dtype.itemsize
    return total


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
