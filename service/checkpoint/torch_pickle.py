"""PyTorch pickle checkpoints (``.bin``/``.pt``/``.pth``, single or sharded) read tensor by tensor.

Shards are opened only with ``torch.load(path, mmap=True, weights_only=True, map_location="cpu")``:
the weights-only unpickler refuses anything but tensors and plain containers (a refusal becomes
:class:`UnsafePickle`), and ``mmap`` means opening a 10 GB shard costs no memory. The catch is
that every page a copy touches then stays in the process RSS (file-backed, but counted and
charged to the cgroup) until unmapped; so after copying a tensor out the reader
``madvise(MADV_DONTNEED)``\\ s the page range it came from. The mapping is private and never
written, so dropped pages are simply re-read from the file if touched again.

Only the zip format written by ``torch.save`` since PyTorch 1.6 can be mmap'd; legacy pickles are
refused with :class:`CheckpointError` rather than loaded into RAM whole.
"""

from __future__ import annotations

import mmap
import pickle
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

from service.checkpoint.base import FileRegion, TensorInfo
from service.errors import CheckpointError, CorruptCheckpoint, UnsafePickle
from service.memory.libc import madvise_dontneed

_PAGE = mmap.PAGESIZE
_WRAPPER_KEYS = ("state_dict", "model", "module")

def release_pages(address: int, length: int) -> None:
    """Drop the whole pages of ``[address, address + length)`` from this process's RSS.

    Rounded inwards so that a page shared with a neighbouring range is kept (it is a few KiB at
    most); only ever called on private, read-only file mappings, where this loses no data.
    """
    start = (address + _PAGE - 1) // _PAGE * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if end > start:
        madvise_dontneed(start, end - start)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one pickle shard, mmap'd and refused unless weights-only-safe."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path.name}: legacy (pre-zip) torch pickle; it cannot be memory-mapped, re-save it "
            "with a recent torch.save or convert it to safetensors"
        )
    try:
        obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UnsafePickle(
            f"{path.name} holds objects other than tensors and plain containers; refused"
        ) from exc
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, KeyError) as exc:
        raise CorruptCheckpoint(f"{path.name}: unreadable torch pickle: {exc}") from exc
    return _tensors_of(path, obj)


def _tensors_of(path: Path, obj: object) -> dict[str, torch.Tensor]:
    if not isinstance(obj, Mapping):
        raise CorruptCheckpoint(
            f"{path.name} does not hold a state dict (got {type(obj).__name__})"
        )
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        # Training checkpoints often wrap the weights: {"state_dict": {...}, "epoch": 3}.
        for key in _WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                return _tensors_of(path, inner)
    for name, t in tensors.items():
        if t.layout != torch.strided or t.is_quantized:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported layout {t.layout}")
    return {k: v.detach() for k, v in tensors.items()}


@dataclass(frozen=True)
class _Stored:
    info: TensorInfo
    tensor: torch.Tensor
    """A view into the shard's mmap; never handed out."""


class PickleReader:
    """One or more ``torch.save`` zip files as one :class:`WeightReader`.

    Every shard is mapped for the reader's lifetime (address space only); resident pages are
    released after each copy, so the RSS a full pass adds is about the largest tensor read.
    """

    def __init__(self, files: Sequence[Path]) -> None:
        self.files = list(files)
        self._stored: dict[str, _Stored] = {}
        self._aliases: dict[str, str] = {}
        for path in self.files:
            self._add_shard(path, load_state_dict(path))

    def _add_shard(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        # Storage order: by address in the mapping, which is the order of the file's records.
        canonical: dict[tuple[object, ...], str] = {}
        for name, t in sorted(
            state.items(), key=lambda kv: (kv[1].untyped_storage().data_ptr(), kv[0])
        ):
            if name in self._stored or name in self._aliases:
                raise CorruptCheckpoint(f"tensor {name!r} is stored in more than one shard")
            key = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
            )
            if key in canonical and t.numel() > 0:
                self._aliases[name] = canonical[key]
                continue
            canonical[key] = name
            info = TensorInfo(name=name, dtype=t.dtype, shape=tuple(t.shape), file=path)
            self._stored[name] = _Stored(info=info, tensor=t)

    # --- WeightReader ------------------------------------------------------------------------

    def tensor_infos(self) -> list[TensorInfo]:
        """Stored tensors only: an alias (tied weight) is listed by :meth:`aliases` instead."""
        return [s.info for s in self._stored.values()]

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def add_alias(self, alias: str, canonical: str) -> None:
        """Serve stored tensor ``canonical`` under the absent name ``alias`` too (a tied weight)."""
        self._stored[canonical]  # KeyError for a name that is not stored
        self._aliases[alias] = canonical

    def read(self, name: str) -> torch.Tensor:
        src = self._lookup(name)
        out = torch.empty(src.shape, dtype=src.dtype)
        out.copy_(src)
        self._release(src)
        return out

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        src = self._lookup(name)
        from_map = src.is_contiguous()
        # A saved strided view (rare) is copied whole first, then handed out in pieces.
        flat = src.view(-1) if from_map else self.read(name).view(-1)
        step = max(1, max_bytes // src.dtype.itemsize)
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            out = piece.clone()
            if from_map:
                release_pages(piece.data_ptr(), piece.numel() * piece.element_size())
            yield out

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements ``[start, start + out.numel())``, then drop their pages."""
        src = self._lookup(name)
        if out.dtype != src.dtype or not out.is_contiguous():
            raise ValueError(f"read_into {name!r} needs a contiguous {src.dtype} buffer")
        if start < 0 or start + out.numel() > src.numel():
            raise IndexError(f"read_into {name!r}: range past the end of the tensor")
        if src.is_contiguous():
            piece = src.view(-1)[start : start + out.numel()]
            out.view(-1).copy_(piece)
            release_pages(piece.data_ptr(), piece.numel() * piece.element_size())
        else:
            out.view(-1).copy_(src.reshape(-1)[start : start + out.numel()])
            self._release(src)

    def region(self, name: str) -> FileRegion | None:
        """None: pickled storages sit inside zip records; callers copy them out instead."""
        self._lookup(name)
        return None

    def close(self) -> None:
        self._stored.clear()
        self._aliases.clear()

    # --- internals ---------------------------------------------------------------------------

    def _lookup(self, name: str) -> torch.Tensor:
        name = self._aliases.get(name, name)
        try:
            return self._stored[name].tensor
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the checkpoint") from None

    @staticmethod
    def _release(src: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        itemsize = src.element_size()
        lo = src.data_ptr()
        span = 1 + sum((d - 1) * s for d, s in zip(src.shape, src.stride(), strict=True) if d > 0)
        release_pages(lo, span * itemsize)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
