"""Fill a meta model from a checkpoint, tensor by tensor: RAM for ``"cpu"``, the store for ``"disk"``.

The checkpoint is read in storage order (sequential I/O) and never more than one tensor is held:
``"cpu"`` tensors become real parameters, ``"disk"`` tensors become :class:`StoreTensor`
handles. Safetensors data is referenced in place (``WeightReader.region``: zero copy); other
formats are streamed once into the store in chunks. Tied parameters share one handle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from service.checkpoint.base import ReadsInParts, TensorInfo, WeightReader
from service.checkpoint.experts import as_model_names
from service.errors import WeightsMismatch
from service.offload.build import BuiltModel, resolve_name, tied_names
from service.offload.device_map import DeviceMap, placement_of, resolve_device_map
from service.offload.quant import QuantEncoding, packed_nbytes
from service.offload.store import OffloadStore
from service.offload.tensor import StoreTensor
from service.shims.transformers_keys import key_renamer
from service.stage import JobContext, Phase

CHUNK_BYTES = 64 << 20
"""Largest piece of a tensor held while copying it into the store."""
COMMIT_EVERY = 64
"""Tensors between two index commits, so a crash loses little (the index is tiny to rewrite)."""


@dataclass
class DispatchResult:
    model: nn.Module
    device_map: DeviceMap
    store: OffloadStore
    placed: dict[str, int] = field(default_factory=dict)
    """Tensors per placement: ``cpu``, ``disk_ref`` (in place), ``disk_owned`` (written)."""
    missing: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"placed": dict(self.placed), "missing": list(self.missing)}


Slot = tuple[nn.Module, str, bool]
"""(module, attribute, is_parameter): one place in the model that holds a tensor."""


def _owners(model: nn.Module) -> dict[str, list[Slot]]:
    """Tensor name -> every (module, attribute, is_parameter) slot holding it (tied included)."""
    slots: dict[str, list[Slot]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, value in module._parameters.items():
            if value is not None:
                slots.setdefault(prefix + attr, []).append((module, attr, True))
        for attr, value in module._buffers.items():
            if value is not None:
                slots.setdefault(prefix + attr, []).append((module, attr, False))
    return slots


def _assign(slots: list[Slot], value: torch.Tensor) -> None:
    param = (
        value if isinstance(value, StoreTensor) else nn.Parameter(value, requires_grad=False)
    )
    for module, attr, is_param in slots:
        if is_param:
            module._parameters[attr] = param  # type: ignore[assignment]
        else:
            module._buffers[attr] = value


def _quantizable(info: TensorInfo, encoding: QuantEncoding | None) -> bool:
    if encoding is None or len(info.shape) != 2 or not info.dtype.is_floating_point:
        return False
    try:
        packed_nbytes(info.shape, encoding)
    except ValueError:
        return False
    return True


def dispatch_checkpoint(
    model: nn.Module,
    reader: WeightReader,
    device_map: DeviceMap,
    store: OffloadStore,
    ctx: JobContext,
    *,
    quantization: QuantEncoding | None = None,
    strict: bool = True,
) -> DispatchResult:
    """Load every checkpoint tensor into ``model`` (built on meta) per ``device_map``.

    ``quantization`` packs 2-D float weights on disk as GGML q8_0/q4_0 blocks (they stay
    offloaded, dequantized on each use). With ``strict``, a parameter left on meta (absent from
    the checkpoint and not tied) raises :class:`WeightsMismatch`. Publishes the OFFLOAD phase
    and ``details.offload``. A MoE's per-expert tensors fill the model's expert stacks as
    transformers converts them (``checkpoint.experts``), referenced in place, run by run.
    """
    reader = as_model_names(reader, model)
    infos = reader.tensor_infos()
    ctx.set_phase(Phase.OFFLOAD, total=sum(i.nbytes for i in infos), unit="bytes")
    dispatcher = _Dispatcher.for_model(model, reader, device_map, store, quantization)
    dispatcher.load_all(infos, ctx)
    missing = dispatcher.still_on_meta()
    if missing and strict:
        raise WeightsMismatch(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
            + ", ".join(missing[:5])
            + (" ..." if len(missing) > 5 else "")
        )
    result = DispatchResult(model, device_map, store, dispatcher.placed, missing)
    publish_offload_metrics(store, ctx, result)
    return result


@dataclass
class _Dispatcher:
    """Puts each checkpoint tensor where the device map says, once per tied group: a real
    parameter in RAM (``cpu``), or a :class:`StoreTensor` over the store (``disk``), written
    quantized, referenced in place in the checkpoint file, or copied in chunks."""

    reader: WeightReader
    device_map: DeviceMap
    store: OffloadStore
    quantization: QuantEncoding | None
    slots: dict[str, list[Slot]]
    """Module tensor name -> every slot holding it."""
    tied: dict[str, str]
    """Tied name -> the canonical name of its group."""
    groups: dict[str, list[Slot]]
    """Canonical name -> the slots of every tied name in its group."""
    prefix: str
    rename: Callable[[str], str] = field(default=str)
    """transformers' own rename rules for the model (``adapters.transformers_keys``)."""
    done: dict[str, str] = field(default_factory=dict)
    """Canonical name -> store key, or ``cpu``."""
    placed: dict[str, int] = field(
        default_factory=lambda: {"cpu": 0, "disk_ref": 0, "disk_owned": 0}
    )
    since_commit: int = 0

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        reader: WeightReader,
        device_map: DeviceMap,
        store: OffloadStore,
        quantization: QuantEncoding | None,
    ) -> _Dispatcher:
        slots = _owners(model)
        tied = tied_names(model)
        groups: dict[str, list[Slot]] = {}
        for name, name_slots in slots.items():
            groups.setdefault(tied.get(name, name), []).extend(name_slots)
        prefix = getattr(model, "base_model_prefix", "") or ""
        return cls(
            reader, device_map, store, quantization, slots, tied, groups, prefix,
            key_renamer(model),
        )  # fmt: skip

    def load_all(self, infos: list[TensorInfo], ctx: JobContext) -> None:
        """Every stored tensor, then every alias the reader knows (a tied name stored once),
        then a final index commit."""
        module_names = set(self.slots)
        by_name = {i.name: i for i in infos}
        for info in infos:
            ctx.check_abort()
            target = resolve_name(info.name, module_names, self.prefix) or resolve_name(
                self.rename(info.name), module_names, self.prefix
            )
            if target is not None:
                self.load(info, info.name, target)
            ctx.advance(info.nbytes)
        for alias, canonical_source in self.reader.aliases().items():
            target = resolve_name(alias, module_names, self.prefix) or resolve_name(
                self.rename(alias), module_names, self.prefix
            )
            if target is not None and canonical_source in by_name:
                self.load(by_name[canonical_source], canonical_source, target)
        self.store.commit()

    def load(self, info: TensorInfo, source_name: str, target: str) -> None:
        """Checkpoint tensor ``source_name`` into module tensor ``target`` and its tied group."""
        canonical = self.tied.get(target, target)
        if canonical in self.done:
            return
        slot = self.groups[canonical]
        current = getattr(slot[0][0], slot[0][1])
        dtype = current.dtype if current is not None else info.dtype
        if tuple(current.shape) != tuple(info.shape):
            raise WeightsMismatch(
                f"{source_name} has shape {list(info.shape)}, the model expects "
                f"{list(current.shape)} for {canonical}"
            )
        is_param = slot[0][2]
        if not is_param or placement_of(canonical, self.device_map) != "disk":
            _assign(slot, self.reader.read(source_name).to(dtype))
            self.placed["cpu"] += 1
            self.done[canonical] = "cpu"
            return
        self._offload(info, source_name, canonical)
        _assign(slot, StoreTensor.from_store(self.store, canonical, dtype))
        self.done[canonical] = canonical
        self.since_commit += 1
        if self.since_commit >= COMMIT_EVERY:
            self.store.commit()
            self.since_commit = 0

    def _offload(self, info: TensorInfo, source_name: str, canonical: str) -> None:
        """Into the store: quantized when asked and possible, else a reference to the bytes in
        the checkpoint file(s) when they can be read in place, else a copy in chunks."""
        region = self.reader.region(source_name)
        runs = None
        if region is None and isinstance(self.reader, ReadsInParts):
            runs = self.reader.regions(source_name)
        if _quantizable(info, self.quantization):
            assert self.quantization is not None
            self.store.put_quantized(canonical, self.reader.read(source_name), self.quantization)
            self.placed["disk_owned"] += 1
        elif region is not None:
            self.store.put_reference(canonical, region, info.dtype, tuple(info.shape))
            self.placed["disk_ref"] += 1
        elif runs is not None:
            self.store.put_reference_parts(canonical, runs, info.dtype, tuple(info.shape))
            self.placed["disk_ref"] += 1
        else:
            self.store.put_chunks(
                canonical,
                self.reader.iter_chunks(source_name, CHUNK_BYTES),
                info.dtype,
                tuple(info.shape),
            )
            self.placed["disk_owned"] += 1

    def still_on_meta(self) -> list[str]:
        """Module tensors the checkpoint did not fill."""
        return [
            name
            for name, slot in self.slots.items()
            if (value := getattr(slot[0][0], slot[0][1])) is not None and value.is_meta
        ]


def dispatch_model(
    built: BuiltModel,
    reader: WeightReader,
    store: OffloadStore,
    ctx: JobContext,
    *,
    max_memory: int | str,
    device_map: Literal["auto"] | dict[str, str] | None = "auto",
    quantization: QuantEncoding | None = None,
    strict: bool = True,
) -> DispatchResult:
    """The pipeline's OFFLOAD phase: plan the device map within ``max_memory``, then dispatch.

    ``device_map`` is ``"auto"`` (whole ``no_split`` modules in RAM front to back, the rest on
    disk) or an explicit ``{module: "cpu" | "disk"}``.
    """
    planned = resolve_device_map(
        built.model, device_map, max_memory, built.no_split_module_classes, built.dtype
    )
    result = dispatch_checkpoint(
        built.model, reader, planned, store, ctx, quantization=quantization, strict=strict
    )
    publish_offload_metrics(store, ctx, result)
    return result


def publish_offload_metrics(
    store: OffloadStore, ctx: JobContext, result: DispatchResult | None = None
) -> dict[str, Any]:
    """Refresh ``details.offload`` and the ``offload_*`` metrics after the store was used
    (forward passes, exports) and persist its counters for GET /v1/offload."""
    section = store.metrics()
    if result is not None:
        section.update(result.summary(), device_map=_summarize_map(result.device_map))
    store.save_metrics()
    ctx.set_detail("offload", section)
    for key in ("bytes_written", "bytes_referenced", "reloads", "bytes_read", "bytes_on_disk"):
        ctx.set_metric(f"offload_{key}", section[key])
    return section


def _summarize_map(device_map: DeviceMap) -> dict[str, Any]:
    """A device map small enough for the job JSON (a 70B map has ~100 entries)."""
    counts = {"cpu": 0, "disk": 0}
    for placement in device_map.values():
        counts[placement] += 1
    return {"modules": counts, "map": dict(device_map) if len(device_map) <= 64 else None}
