"""The directory of a GGUF file (scalar metadata and tensor infos), read without its vocabulary.

``gguf.GGUFReader`` materializes every element of every KV array as numpy views: for a
Llama-3 vocabulary (128k tokens, 280k merges) that is about a minute and 600 MiB, more than the
whole export budget. Verification only needs the architecture, the alignment and each tensor's
name, type, shape and offset, so this reads the GGUF v3 header sequentially, decodes scalar and
string values, and skips arrays by their lengths. The tests check it against ``GGUFReader`` on
our files and on a file made by llama.cpp.

Layout (little-endian): magic ``GGUF``, version u32, tensor count u64, KV count u64; each KV is
a string key, a u32 value type and the value (strings are a u64 length then bytes; arrays a u32
item type, a u64 count, then the items); each tensor info is a string name, u32 dimension
count, u64 dimensions (ggml order: ``ne[0]`` is the row length), u32 ggml type, u64 offset
relative to the data section, which starts at the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from service.errors import VerificationFailed

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAGIC = 0x46554747
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class StoredTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    """Row-major (torch) order, i.e. ggml's dimensions reversed."""
    offset: int
    """Absolute position of the first byte in the file."""


@dataclass(frozen=True)
class GGUFDirectory:
    version: int
    metadata: dict[str, Any]
    """Scalar and string values; arrays appear as ``("array", item_type, count)``."""
    tensors: list[StoredTensor]
    data_offset: int


def read_directory(path: Path) -> GGUFDirectory:
    """Parse the header of ``path``; raises :class:`VerificationFailed` if it is not GGUF."""
    with open(path, "rb", buffering=1 << 20) as f:
        try:
            return _read(f, path.name)
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise VerificationFailed(f"{path.name}: unreadable GGUF header ({exc})") from None


def _read(f: IO[bytes], name: str) -> GGUFDirectory:
    magic, version, n_tensors, n_kv = struct.unpack("<IIQQ", _exact(f, 24))
    if magic != _MAGIC or version not in (2, 3):
        raise VerificationFailed(f"{name}: not a GGUF v2/v3 file")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(f)
        (vtype,) = struct.unpack("<I", _exact(f, 4))
        metadata[key] = _value(f, vtype)
    tensors: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        tname = _string(f)
        (n_dims,) = struct.unpack("<I", _exact(f, 4))
        dims = struct.unpack(f"<{n_dims}Q", _exact(f, 8 * n_dims))
        ggml_type, offset = struct.unpack("<IQ", _exact(f, 12))
        tensors.append((tname, ggml_type, tuple(reversed(dims)), offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_offset = -(-f.tell() // alignment) * alignment
    return GGUFDirectory(
        version,
        metadata,
        [StoredTensor(n, t, s, data_offset + o) for n, t, s, o in tensors],
        data_offset,
    )


def _exact(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated header")
    return data


def _string(f: IO[bytes]) -> str:
    (n,) = struct.unpack("<Q", _exact(f, 8))
    return _exact(f, n).decode("utf-8")


def _value(f: IO[bytes], vtype: int) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        itype, count = struct.unpack("<IQ", _exact(f, 12))
        _skip_items(f, itype, count)
        return ("array", itype, count)
    raise ValueError(f"unknown value type {vtype}")


def _skip_items(f: IO[bytes], itype: int, count: int) -> None:
    if itype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[itype]) * count, 1)
    elif itype == _STRING:
        for _ in range(count):
            (n,) = struct.unpack("<Q", _exact(f, 8))
            f.seek(n, 1)
    elif itype == _ARRAY:
        for _ in range(count):
            inner, n = struct.unpack("<IQ", _exact(f, 12))
            _skip_items(f, inner, n)
    else:
        raise ValueError(f"unknown array item type {itype}")
