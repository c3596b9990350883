"""What a checkpoint is, read from its headers alone: tensor names, dtypes, shapes, file sizes.

A job's plan (peak RSS of the job and of each consumer child, disk) is computed before any
weight is read, from the same few kilobytes whatever the source: a local directory's
safetensors headers, the first bytes of an HTTP file (a ``Range`` read that stops after the
header), or a hub commit's file listing plus each shard's header. Each source builds a
:class:`CheckpointHeaders` (``SourceFetcher.headers``); the exporters' plans read only that.

A pickle checkpoint has no header: its tensors are unknown until unpickled, so its
:class:`CheckpointHeaders` holds file sizes and the config only (``tensors`` empty), and plans
fall back to what the config says of the largest matrices.

No torch here: the API process builds these at submission.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from service.errors import CorruptCheckpoint

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The reference implementation's cap: a larger header is an attack or garbage."""

ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "C64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1,
}  # fmt: skip
"""Bytes per element of each safetensors dtype."""

FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})

Format = Literal["safetensors", "pickle"]


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    """The safetensors dtype name (``F32``, ``BF16``...)."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def floating(self) -> bool:
        return self.dtype in FLOATING


@dataclass(frozen=True)
class CheckpointHeaders:
    """A checkpoint's description without its weights (see the module docstring)."""

    format: Format
    files: Mapping[str, int]
    """Every file a job would download or read (weights and the files travelling with them)
    -> its size in bytes."""
    tensors: tuple[TensorHeader, ...] = ()
    """Every stored tensor (safetensors); empty for a pickle checkpoint."""
    config: dict[str, Any] | None = None
    """config.json when the source has a usable one."""
    weight_files: tuple[str, ...] = field(default=())
    """The names in ``files`` that hold weights."""
    remote: bool = False
    """Whether a job downloads ``files`` (hub, HTTP) rather than reading them in place."""

    @property
    def download_bytes(self) -> int:
        """Bytes a job downloads before it starts (0 for a local source)."""
        return sum(self.files.values()) if self.remote else 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights: the tensors' when known, else the weight files' sizes."""
        if self.tensors:
            return sum(t.nbytes for t in self.tensors)
        return sum(self.files.get(f, 0) for f in self.weight_files)

    def largest(self, predicate: Callable[[TensorHeader], bool] | None = None) -> TensorHeader | None:
        """The tensor with the most elements (among those ``predicate`` keeps), or None."""
        kept = [t for t in self.tensors if predicate is None or predicate(t)]
        return max(kept, key=lambda t: t.numel, default=None)

    @property
    def source_dtype(self) -> str | None:
        """The dtype most floating bytes are stored in (``F32``, ``BF16``...), or None."""
        totals: dict[str, int] = {}
        for t in self.tensors:
            if t.floating:
                totals[t.dtype] = totals.get(t.dtype, 0) + t.nbytes
        return max(totals, key=lambda d: totals[d]) if totals else None


def header_length(prefix: bytes, name: str) -> int:
    """The JSON header's length from a safetensors file's first 8 bytes."""
    if len(prefix) < 8:
        raise CorruptCheckpoint(f"{name}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpoint(f"{name}: header length {n} is implausibly large")
    return int(n)


def parse_header_json(raw: bytes, name: str) -> list[TensorHeader]:
    """The tensors of a safetensors JSON header (the bytes after the length prefix).

    Checks what a plan relies on (known dtypes, integer shapes); the job's reader validates
    the rest (offsets, coverage) when it opens the file."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptCheckpoint(f"{name}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{name}: header is not a JSON object")
    tensors = []
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        dtype = spec.get("dtype") if isinstance(spec, dict) else None
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if dtype not in ITEMSIZE or not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise CorruptCheckpoint(f"{name}: malformed header entry for {key!r}")
        tensors.append(TensorHeader(key, str(dtype), tuple(shape)))
    return tensors


def read_file_header(read: Callable[[int, int], bytes], name: str) -> list[TensorHeader]:
    """The tensors of one safetensors file, from ``read(offset, length)`` (a local ``pread``,
    an HTTP range read): two reads, the length prefix then the header, never the data."""
    n = header_length(read(0, 8), name)
    raw = read(8, n)
    if len(raw) != n:
        raise CorruptCheckpoint(f"{name}: header cut short ({len(raw)} of {n} bytes)")
    return parse_header_json(raw, name)


PROBE_BYTES = 1 << 20
"""A remote header is asked for with ``Range: bytes=0-<PROBE_BYTES - 1>``: one request holds
nearly every header (a 70B's is ~100 KB); a longer one takes a second range request. The
reader hangs up once the header is in (:class:`HeaderBuffer`), so a tiny header does not cost
the whole MiB, only what the connection had buffered. On loopback, of a 64 MiB file whose
server ignores ``Range``: 4 KiB handed over by olah, 3.8 MiB by a plain file server
(tests/integration/sources/test_headers.py). A file smaller than this is, at worst, sent whole."""


class HeaderBuffer:
    """The first bytes of a safetensors file, fed as they arrive from a response body, until
    the header is complete: the caller stops reading there (a server that ignores ``Range``
    and sends the whole file is cut off after the header)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data = bytearray()
        self.need = 8
        """Bytes that complete the header (8 until the length prefix is in)."""

    def feed(self, chunk: bytes) -> bool:
        """Add ``chunk``; True once the header is complete."""
        self.data += chunk
        if self.need == 8 and len(self.data) >= 8:
            self.need = 8 + header_length(bytes(self.data[:8]), self.name)
        return len(self.data) >= self.need

    def tensors(self) -> list[TensorHeader]:
        if len(self.data) < self.need:
            raise CorruptCheckpoint(f"{self.name}: header cut short")
        return parse_header_json(bytes(self.data[8 : self.need]), self.name)


def local_file_header(path: Path) -> list[TensorHeader]:
    """The tensors of the local safetensors file ``path``."""
    with path.open("rb") as f:

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return read_file_header(read, path.name)


def config_of(raw: bytes | str | None) -> dict[str, Any] | None:
    """config.json's object, or None when absent or unusable (as the job would see it)."""
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None
