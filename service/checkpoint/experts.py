"""A MoE checkpoint read in the other expert layout: per-expert tensors as packed stacks, or back.

transformers 5 holds a MoE layer's experts as one tensor per projection
(``experts.gate_up_proj`` ``[E, 2I, H]``); the Hub's checkpoints hold one tensor per expert.
Which stored tensors make which stack, in which order and along which dimension, is
transformers' own conversion (:mod:`service.shims.transformers_experts`); this module reads it
as a layout. A stack is ``cat([stack(parts of pattern p) for p], dim=concat_dim)``, so its
flattened elements are runs of the parts' flattened elements: with ``concat_dim`` 1 (every
family transformers 5.23 packs) each expert's parts follow each other whole
(``e0.w1, e0.w3, e1.w1, ...``). Reads walk those runs:

* serving a stack from per-expert tensors, a read of any element range reads only the parts it
  covers, each straight into the caller's buffer; a whole-stack read by a reader without
  ``read_into`` holds one part at a time. Memory is never a layer's experts: the caller's
  buffer plus at most one expert's tensor;
* serving a part from a stored stack, its elements are one range of the stack (in place, for
  the offload store, through :meth:`ExpertLayoutReader.region`);
* the offload store references a stack's runs in place (:meth:`ExpertLayoutReader.regions`):
  packing costs no disk.

Every other tensor is served under the name transformers gives it (Mixtral's router
``block_sparse_moe.gate`` <-> ``mlp.gate``), bytes untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from service.checkpoint.base import FileRegion, ReadsInto, TensorInfo, WeightReader
from service.errors import WeightsMismatch
from service.shims.transformers_experts import ExpertConversion, ExpertStack, packing, unpacking

if TYPE_CHECKING:
    import torch

ExpertLayout = Literal["per_expert", "packed"]


@dataclass(frozen=True)
class StackGeometry:
    """Where each part's elements lie in the flattened stack.

    The stack is ``experts`` blocks of ``outer`` rows; a row is each pattern's run of
    ``inner[p]`` elements in turn (``outer`` is 1 when the patterns join along dimension 1:
    a row is then every part of one expert, whole)."""

    stack: ExpertStack
    part_shapes: tuple[tuple[int, ...], ...]
    """Shape of one part of each pattern."""
    shape: tuple[int, ...]
    """The packed tensor's shape."""
    dtype: torch.dtype
    outer: int
    inner: tuple[int, ...]

    @classmethod
    def of_parts(
        cls, stack: ExpertStack, shapes: list[tuple[int, ...]], dtype: torch.dtype
    ) -> StackGeometry:
        """The stack built from parts of ``shapes`` (one per pattern); every expert's part of
        a pattern must have its shape (checked by the caller)."""
        d = stack.concat_dim - 1
        first = shapes[0]
        if d >= len(first) or any(
            len(s) != len(first) or s[:d] + s[d + 1 :] != first[:d] + first[d + 1 :]
            for s in shapes
        ):
            raise WeightsMismatch(
                f"the experts of {stack.packed} cannot be joined along dimension "
                f"{stack.concat_dim}: their shapes are {[list(s) for s in shapes]}"
            )
        joined = (*first[:d], sum(s[d] for s in shapes), *first[d + 1 :])
        return cls(
            stack, tuple(shapes), (stack.experts, *joined), dtype, math.prod(first[:d]),
            tuple(math.prod(s[d:]) for s in shapes),
        )  # fmt: skip

    @classmethod
    def of_stack(
        cls, stack: ExpertStack, shape: tuple[int, ...], dtype: torch.dtype
    ) -> StackGeometry:
        """The parts of a stored stack of ``shape``, cut in equal pieces along ``concat_dim``
        (as transformers' ``Chunk`` cuts it when it saves)."""
        d, patterns = stack.concat_dim, len(stack.parts)
        if len(shape) <= d or shape[0] != stack.experts or shape[d] % patterns:
            raise WeightsMismatch(
                f"{stack.packed} has shape {list(shape)}: not {stack.experts} experts of "
                f"{patterns} equal part(s) along dimension {d}"
            )
        part = (*shape[1:d], shape[d] // patterns, *shape[d + 1 :])
        return cls.of_parts(stack, [part] * patterns, dtype)

    @property
    def row(self) -> int:
        return sum(self.inner)

    @property
    def per_expert(self) -> int:
        return self.outer * self.row

    @property
    def numel(self) -> int:
        return self.stack.experts * self.per_expert

    def pieces(self, start: int, count: int) -> Iterator[tuple[str, int, int]]:
        """``(part name, first element in the part, elements)`` covering stack elements
        ``[start, start + count)``, in order."""
        if start < 0 or start + count > self.numel:
            raise IndexError(f"{self.stack.packed}: range past the end of the stack")
        while count > 0:
            expert, rest = divmod(start, self.per_expert)
            o, within = divmod(rest, self.row)
            p = 0
            while within >= self.inner[p]:
                within -= self.inner[p]
                p += 1
            n = min(count, self.inner[p] - within)
            yield self.stack.parts[p][expert], o * self.inner[p] + within, n
            start += n
            count -= n

    def part_ranges(self, p: int, expert: int, start: int, count: int) -> Iterator[tuple[int, int]]:
        """``(first element in the stack, elements)`` covering elements ``[start, start +
        count)`` of part ``[p][expert]``, in order."""
        if start < 0 or start + count > self.outer * self.inner[p]:
            raise IndexError(f"{self.stack.parts[p][expert]}: range past the end of the tensor")
        offset = expert * self.per_expert + sum(self.inner[:p])
        while count > 0:
            o, within = divmod(start, self.inner[p])
            n = min(count, self.inner[p] - within)
            yield offset + o * self.row + within, n
            start += n
            count -= n


class ExpertLayoutReader:
    """A :class:`WeightReader` over ``inner`` serving the other expert layout of ``conversion``
    (stacks from per-expert tensors when it ``packs``, else parts from stored stacks) and every
    other tensor under its converted name. Raises :class:`WeightsMismatch` when the stored
    parts of a stack disagree in shape or dtype."""

    def __init__(self, inner: WeightReader, conversion: ExpertConversion) -> None:
        self.inner, self.conversion = inner, conversion
        stored = inner.tensor_infos()
        self._source: dict[str, str] = {}
        """Served name -> stored name, for every tensor served as it is stored."""
        self._stacks: dict[str, StackGeometry] = {}
        """Packing: served stack name -> geometry."""
        self._parts: dict[str, tuple[StackGeometry, int, int]] = {}
        """Unpacking: served part name -> (geometry, pattern, expert)."""
        infos: list[TensorInfo] = []
        stacks = {s.packed: s for s in conversion.stacks}
        first = {s.parts[0][0]: s for s in conversion.stacks}
        in_stacks = {n for s in conversion.stacks for n in s.names()}
        by_name = {i.name: i for i in stored}
        for info in stored:
            if conversion.packs and info.name in first:
                geometry = _geometry_of_parts(first[info.name], by_name)
                self._stacks[geometry.stack.packed] = geometry
                infos.append(replace(info, name=geometry.stack.packed, shape=geometry.shape))
            elif conversion.packs and info.name in in_stacks:
                continue  # served inside its stack
            elif not conversion.packs and info.name in stacks:
                stack = stacks[info.name]
                geometry = StackGeometry.of_stack(stack, info.shape, info.dtype)
                for e in range(stack.experts):
                    for p, names in enumerate(stack.parts):
                        self._parts[names[e]] = (geometry, p, e)
                        infos.append(replace(info, name=names[e], shape=geometry.part_shapes[p]))
            else:
                served = conversion.renamed.get(info.name, info.name)
                self._source[served] = info.name
                infos.append(replace(info, name=served))
        served_as = {stored_name: served for served, stored_name in self._source.items()}
        self._aliases: dict[str, str] = {}
        """Served alias -> served canonical name (a tie the files store once)."""
        for alias, canonical in inner.aliases().items():
            if canonical in served_as:
                served = conversion.renamed.get(alias, alias)
                self._source[served] = alias
                self._aliases[served] = served_as[canonical]
        self._infos = infos
        self._by_name = {i.name: i for i in infos}
        self._cached: tuple[str, torch.Tensor] | None = None
        """The last stored tensor read whole (readers without ``read_into``): one expert's."""

    # --- WeightReader ------------------------------------------------------------------------

    def tensor_infos(self) -> list[TensorInfo]:
        return list(self._infos)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def add_alias(self, alias: str, canonical: str) -> None:
        self.inner.add_alias(alias, self._source[canonical])
        self._source[alias] = alias
        self._aliases[alias] = canonical

    def read(self, name: str) -> torch.Tensor:
        import torch

        if name in self._stacks:
            geometry = self._stacks[name]
            out = torch.empty(geometry.numel, dtype=geometry.dtype)
            self.read_into(name, 0, out)
            return out.reshape(geometry.shape)
        if name in self._parts:
            geometry, p, _ = self._parts[name]
            out = torch.empty(math.prod(geometry.part_shapes[p]), dtype=geometry.dtype)
            self.read_into(name, 0, out)
            return out.reshape(geometry.part_shapes[p])
        return self.inner.read(self._source[name])

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        import torch

        if name not in self._stacks and name not in self._parts:
            yield from self.inner.iter_chunks(self._source[name], max_bytes)
            return
        info = self._by_name[name]
        step = max(1, max_bytes // info.dtype.itemsize)
        for start in range(0, info.numel, step):
            out = torch.empty(min(step, info.numel - start), dtype=info.dtype)
            self.read_into(name, start, out)
            yield out

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the flattened served tensor, read from
        the stored tensors they lie in, each piece straight into ``out``."""
        flat = out.reshape(-1)
        if name in self._stacks:
            at = 0
            for part, first, n in self._stacks[name].pieces(start, flat.numel()):
                self._read_stored(part, first, flat[at : at + n])
                at += n
        elif name in self._parts:
            geometry, p, expert = self._parts[name]
            at = 0
            for first, n in geometry.part_ranges(p, expert, start, flat.numel()):
                self._read_stored(geometry.stack.packed, first, flat[at : at + n])
                at += n
        else:
            self._read_stored(self._source[name], start, flat)

    def region(self, name: str) -> FileRegion | None:
        """In place: a renamed tensor, or a part that is one range of its stored stack."""
        if name in self._stacks:
            return None
        if name in self._parts:
            geometry, p, expert = self._parts[name]
            ranges = list(geometry.part_ranges(p, expert, 0, geometry.outer * geometry.inner[p]))
            whole = self.inner.region(geometry.stack.packed)
            if whole is None or len(ranges) != 1:
                return None
            first, n = ranges[0]
            size = geometry.dtype.itemsize
            return FileRegion(whole.path, whole.offset + first * size, n * size)
        return self.inner.region(self._source[name])

    def regions(self, name: str) -> list[FileRegion] | None:
        """A stack's runs in the files of its parts, adjacent runs merged; None when a part
        cannot be used in place."""
        if name not in self._stacks:
            region = self.region(name)
            return None if region is None else [region]
        geometry = self._stacks[name]
        size = geometry.dtype.itemsize
        out: list[FileRegion] = []
        for part, first, n in geometry.pieces(0, geometry.numel):
            whole = self.inner.region(part)
            if whole is None:
                return None
            piece = FileRegion(whole.path, whole.offset + first * size, n * size)
            last = out[-1] if out else None
            if last and last.path == piece.path and last.offset + last.length == piece.offset:
                out[-1] = FileRegion(last.path, last.offset, last.length + piece.length)
            else:
                out.append(piece)
        return out

    def close(self) -> None:
        self._cached = None
        self.inner.close()

    # --- internals ---------------------------------------------------------------------------

    def _read_stored(self, name: str, start: int, out: torch.Tensor) -> None:
        if isinstance(self.inner, ReadsInto):
            self.inner.read_into(name, start, out)
            return
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # the previous part goes before the next is read
            self._cached = (name, self.inner.read(name).reshape(-1))
        out.copy_(self._cached[1][start : start + out.numel()])


def _geometry_of_parts(stack: ExpertStack, by_name: dict[str, TensorInfo]) -> StackGeometry:
    """The stack's geometry from its stored parts, which must agree in shape per pattern and
    in dtype."""
    shapes: list[tuple[int, ...]] = []
    dtypes = set()
    for names in stack.parts:
        pattern_shapes = {by_name[n].shape for n in names}
        dtypes |= {by_name[n].dtype for n in names}
        if len(pattern_shapes) != 1:
            raise WeightsMismatch(
                f"the experts of {stack.packed} differ in shape: "
                f"{sorted(list(s) for s in pattern_shapes)} among {names[0]}..."
            )
        shapes.append(pattern_shapes.pop())
    if len(dtypes) != 1:
        raise WeightsMismatch(
            f"the experts of {stack.packed} differ in dtype: {sorted(map(str, dtypes))}"
        )
    return StackGeometry.of_parts(stack, shapes, dtypes.pop())


def as_model_names(reader: WeightReader, model: Any) -> WeightReader:
    """``reader`` as ``model`` (built by transformers) names its tensors: per-expert tensors
    packed into the model's stacks, as ``from_pretrained`` converts them; ``reader`` itself
    when nothing is to be converted."""
    conversion = packing(model, [i.name for i in reader.tensor_infos()])
    return reader if conversion is None else ExpertLayoutReader(reader, conversion)


def stored_layout(reader: WeightReader, model: Any) -> ExpertLayout | None:
    """How ``reader`` stores ``model``'s experts, None for a model without expert stacks."""
    infos = reader.tensor_infos()
    if packing(model, [i.name for i in infos]) is not None:
        return "per_expert"
    if unpacking(model, {i.name: i.shape for i in infos}) is not None:
        return "packed"
    return None


def in_layout(reader: WeightReader, model: Any, layout: ExpertLayout) -> WeightReader:
    """``reader`` with ``model``'s experts served in ``layout``: packed as transformers 5's
    modules hold them, or one tensor per expert as ``save_pretrained`` writes them (and the
    Hub has them); ``reader`` itself when it already stores them so, or holds no experts."""
    infos = reader.tensor_infos()
    if layout == "packed":
        conversion = packing(model, [i.name for i in infos])
    else:
        conversion = unpacking(model, {i.name: i.shape for i in infos})
    return reader if conversion is None else ExpertLayoutReader(reader, conversion)
