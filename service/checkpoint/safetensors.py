"""Safetensors files read tensor by tensor with ``pread`` into fresh tensors, after a strict header check.

Format: 8-byte little-endian header length ``N``, ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the
data section; offsets are relative to the data section. The header is validated the way the
reference implementation validates it (known dtypes, sizes matching shapes, regions contiguous,
non-overlapping and covering the data section exactly) so that a truncated download or a lying
header fails at open with :class:`CorruptCheckpoint` instead of producing garbage later.

Data is read with ``preadv`` rather than ``mmap``: mmap'd pages are counted in the process RSS
until unmapped, which defeats the bounded-memory promise on a 100 GB checkpoint. After each read
the page-cache range is released with ``posix_fadvise(DONTNEED)`` (see ``drop_page_cache``) so a
full pass over a checkpoint does not evict everything else on the host.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from service.checkpoint.base import FileRegion, TensorInfo
from service.errors import CheckpointError, CorruptCheckpoint

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Same cap as the reference implementation: a larger header is an attack or garbage."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset of the first byte, relative to the data section."""
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_start: int
    """Absolute file offset of the data section (8 + header length)."""
    entries: list[HeaderEntry]
    """In storage (offset) order."""
    metadata: dict[str, str]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise CorruptCheckpoint(f"duplicate key {key!r} in safetensors header")
        seen[key] = value
    return seen


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(path: Path) -> SafetensorsHeader:
    """Read and strictly validate the header of ``path``; raise :class:`CorruptCheckpoint`."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpoint(f"{path.name}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CorruptCheckpoint(f"{path.name}: header length {n} is implausibly large")
            if 8 + n > size:
                raise CorruptCheckpoint(
                    f"{path.name}: header length {n} runs past the end of the file ({size} bytes)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path.name}: cannot read: {exc.strerror}") from exc
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{path.name}: header is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. [[[[...]]]] thousands deep: no real header nests
        raise CorruptCheckpoint(f"{path.name}: header JSON is nested too deeply") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{path.name}: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptCheckpoint(f"{path.name}: __metadata__ must map strings to strings")

    entries = [_entry(path, name, spec) for name, spec in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    data_len = size - 8 - n
    cursor = 0
    for e in entries:
        if e.begin < cursor:
            raise CorruptCheckpoint(f"{path.name}: tensor {e.name!r} overlaps the previous one")
        if e.begin > cursor:
            raise CorruptCheckpoint(
                f"{path.name}: gap before tensor {e.name!r} in the data section"
            )
        if e.end > data_len:
            raise CorruptCheckpoint(
                f"{path.name}: tensor {e.name!r} ends at {e.end} but the data section has "
                f"{data_len} bytes (truncated file?)"
            )
        cursor = e.end
    if cursor != data_len:
        raise CorruptCheckpoint(
            f"{path.name}: data section has {data_len} bytes but tensors cover {cursor}"
        )
    return SafetensorsHeader(path=path, data_start=8 + n, entries=entries, metadata=metadata)


def _entry(path: Path, name: str, spec: object) -> HeaderEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CorruptCheckpoint(f"{path.name}: malformed header entry for {name!r}")
    dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise CorruptCheckpoint(f"{path.name}: unknown dtype {spec['dtype']!r} for {name!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptCheckpoint(f"{path.name}: bad shape {shape!r} for {name!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptCheckpoint(f"{path.name}: bad data_offsets {offsets!r} for {name!r}")
    numel = 1
    for d in shape:
        numel *= d
    begin, end = offsets
    if end - begin != numel * dtype.itemsize:
        raise CorruptCheckpoint(
            f"{path.name}: {name!r} spans {end - begin} bytes but shape {shape} of "
            f"{spec['dtype']} needs {numel * dtype.itemsize}"
        )
    return HeaderEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; a short file is a corrupt checkpoint."""
    done, total = 0, len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpoint("unexpected end of file while reading tensor data")
        done += n


def drop_cached_range(fd: int, offset: int, length: int) -> None:
    """Tell the kernel the range will not be re-read soon (page cache only; never affects data)."""
    if length > 0 and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def read_range(
    fd: int, offset: int, length: int, dtype: torch.dtype, drop_page_cache: bool
) -> torch.Tensor:
    """A fresh flat tensor of ``dtype`` holding ``length`` bytes read at ``offset``."""
    buf = torch.empty(length, dtype=torch.uint8)
    if length:
        pread_into(fd, buf.numpy().data.cast("B"), offset)
        if drop_page_cache:
            drop_cached_range(fd, offset, length)
    return buf.view(dtype)


class SafetensorsReader:
    """One or more safetensors files (the shards of a checkpoint) as one :class:`WeightReader`."""

    MAX_OPEN_FILES = 8

    def __init__(self, files: Sequence[Path], drop_page_cache: bool = True) -> None:
        self.files = list(files)
        self.drop_page_cache = drop_page_cache
        self.headers = [parse_header(p) for p in self.files]
        self._entries: dict[str, tuple[SafetensorsHeader, HeaderEntry]] = {}
        for header in self.headers:
            for entry in header.entries:
                if entry.name in self._entries:
                    other = self._entries[entry.name][0].path.name
                    raise CorruptCheckpoint(
                        f"tensor {entry.name!r} is stored in both {other} and {header.path.name}"
                    )
                self._entries[entry.name] = (header, entry)
        self._sizes = {
            h.path: h.data_start + (h.entries[-1].end if h.entries else 0) for h in self.headers
        }
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._aliases: dict[str, str] = {}

    # --- WeightReader ------------------------------------------------------------------------

    def tensor_infos(self) -> list[TensorInfo]:
        return [
            TensorInfo(name=e.name, dtype=e.dtype, shape=e.shape, file=h.path)
            for h in self.headers
            for e in h.entries
        ]

    def aliases(self) -> dict[str, str]:
        """Only names added by :meth:`add_alias`: the format forbids overlapping regions (the
        header check enforces it), so a tie is never stored, only implied by the config."""
        return dict(self._aliases)

    def add_alias(self, alias: str, canonical: str) -> None:
        """Serve stored tensor ``canonical`` under the absent name ``alias`` too (a tied weight)."""
        self._entries[canonical]  # KeyError for a name that is not stored
        self._aliases[alias] = canonical

    def read(self, name: str) -> torch.Tensor:
        header, entry = self._lookup(name)
        flat = read_range(
            self._fd(header.path),
            header.data_start + entry.begin,
            entry.end - entry.begin,
            entry.dtype,
            self.drop_page_cache,
        )
        return flat.reshape(entry.shape)

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        header, entry = self._lookup(name)
        itemsize = entry.dtype.itemsize
        step = max(1, max_bytes // itemsize) * itemsize
        start = header.data_start + entry.begin
        for off in range(0, entry.end - entry.begin, step):
            length = min(step, entry.end - entry.begin - off)
            yield read_range(
                self._fd(header.path), start + off, length, entry.dtype, self.drop_page_cache
            )

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements ``[start, start + out.numel())`` straight from the file."""
        header, entry = self._lookup(name)
        itemsize = entry.dtype.itemsize
        length = out.numel() * itemsize
        if out.dtype != entry.dtype or not out.is_contiguous():
            raise ValueError(f"read_into {name!r} needs a contiguous {entry.dtype} buffer")
        if start < 0 or start * itemsize + length > entry.end - entry.begin:
            raise IndexError(f"read_into {name!r}: range past the end of the tensor")
        if length == 0:
            return
        offset = header.data_start + entry.begin + start * itemsize
        fd = self._fd(header.path)
        pread_into(fd, out.reshape(-1).view(torch.uint8).numpy().data.cast("B"), offset)
        if self.drop_page_cache:
            drop_cached_range(fd, offset, length)

    def region(self, name: str) -> FileRegion:
        header, entry = self._lookup(name)
        return FileRegion(
            path=header.path, offset=header.data_start + entry.begin, length=entry.end - entry.begin
        )

    def close(self) -> None:
        while self._fds:
            _, fd = self._fds.popitem()
            os.close(fd)

    # --- internals ---------------------------------------------------------------------------

    def _lookup(self, name: str) -> tuple[SafetensorsHeader, HeaderEntry]:
        try:
            return self._entries[self._aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the checkpoint") from None

    def _fd(self, path: Path) -> int:
        # A small LRU of descriptors: reading in storage order touches one shard at a time, and
        # a 1000-shard checkpoint must not exhaust the process's file descriptors.
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"{path.name}: cannot open: {exc.strerror}") from exc
        if os.fstat(fd).st_size != self._sizes[path]:
            os.close(fd)
            raise CorruptCheckpoint(f"{path.name}: file changed size since it was opened")
        self._fds[path] = fd
        while len(self._fds) > self.MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
