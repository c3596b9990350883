"""Writing a GGUF file one tensor at a time, and reading it back the same way to verify it.

``gguf.GGUFWriter`` keeps every tensor until ``write_tensors_to_file``; here it only lays out the
file: KV metadata and every tensor info (name, shape, type, offset) are known from the plan, so
its header, KV and tensor-info writers run first, then data is streamed through its open file in
row blocks of at most ``chunk_bytes`` (read, permute, convert/quantize, write, free), each tensor
padded to the alignment as ``GGUFWriter.write_tensor_data`` would. The sha256 is computed while
writing. Only q/k projections (which need all rows to permute) are held whole.

Verification parses the file with ``gguf.GGUFReader`` (names, shapes, types, offsets), then reads
each tensor's bytes with ``os.pread`` in row blocks, so no memory-mapped page stays resident,
dequantizes them with ``gguf.quants`` and compares with the source within the type's bound.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import ExportFailed, VerificationFailed
from service.exporters.gguf_plan import GGUFPlan, TensorPlan, permute_qk, unpermute_qk

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFWriter

    from service.checkpoint.base import WeightReader

CHUNK_BYTES = 64 * 1024**2
"""Float32 bytes of one row block: bounds what a tensor costs in memory beyond its source."""


class Progress(Protocol):
    """What the writer reports between row blocks (a ``JobContext`` satisfies it)."""

    def advance(self, n: int) -> None: ...

    def check_abort(self) -> None: ...


# --- reading source rows -----------------------------------------------------------------------


def _rows_per_block(shape: tuple[int, ...], chunk_bytes: int) -> tuple[int, int]:
    ncols = shape[-1] if shape else 1
    nrows = math.prod(shape) // ncols if ncols else 0
    return max(1, chunk_bytes // max(1, ncols * 4)), nrows


def source_blocks(
    reader: WeightReader, tensor: TensorPlan, chunk_bytes: int, permuted: bool = True
) -> Iterator[np.ndarray]:
    """The source tensor as float32 row blocks ``(rows, ncols)``, permuted as planned."""
    import numpy as np
    import torch

    ncols = tensor.shape[-1] if tensor.shape else 1
    per, _ = _rows_per_block(tensor.shape, chunk_bytes)
    if tensor.values is not None:
        yield np.asarray(tensor.values, dtype=np.float32).reshape(-1, ncols)
        return
    assert tensor.source is not None
    if tensor.permute_heads is not None and permuted:
        whole = reader.read(tensor.source).to(torch.float32).numpy()
        whole = permute_qk(whole, tensor.permute_heads).reshape(-1, ncols)
        for start in range(0, whole.shape[0], per):
            yield np.ascontiguousarray(whole[start : start + per])
        return
    want = per * ncols
    pending: list[np.ndarray] = []
    held = 0
    for chunk in reader.iter_chunks(tensor.source, chunk_bytes):
        flat = chunk.reshape(-1).to(torch.float32).numpy()
        pending.append(flat)
        held += flat.size
        while held >= want:
            buf = np.concatenate(pending) if len(pending) > 1 else pending[0]
            yield buf[:want].reshape(-1, ncols)
            rest = buf[want:]
            pending, held = [rest], rest.size
    if held:
        buf = np.concatenate(pending) if len(pending) > 1 else pending[0]
        if held % ncols:
            raise ExportFailed(f"{tensor.source}: reader returned {held} stray elements")
        yield buf.reshape(-1, ncols)


def encode(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """Float32 rows in the tensor's storage type, as ``gguf.quants.quantize`` encodes them."""
    from gguf import GGMLQuantizationType, quants

    encoded: np.ndarray = quants.quantize(rows, GGMLQuantizationType(ggml_type))
    return encoded


# --- writing -----------------------------------------------------------------------------------


def write_gguf(
    path: Path,
    plan: GGUFPlan,
    reader: WeightReader,
    add_metadata: Callable[[GGUFWriter], None],
    progress: Progress,
    chunk_bytes: int = CHUNK_BYTES,
) -> str:
    """Write ``plan`` to ``path`` atomically; returns the file's sha256."""
    import gguf
    import numpy as np

    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(None, plan.arch_name)
    add_metadata(writer)
    for t in plan.tensors:
        writer.add_tensor_info(
            t.name,
            t.shape,
            np.dtype(np.float32),
            t.nbytes,
            raw_dtype=gguf.GGMLQuantizationType(t.ggml_type),
        )
    digest = hashlib.sha256()
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        out = writer.fout[0]
        writer.write_padding(out, out.tell())
        out.flush()
        header_len = out.tell()
        with open(tmp, "rb") as head:
            digest.update(head.read(header_len))
        for t in plan.tensors:
            progress.check_abort()
            written = 0
            for rows in source_blocks(reader, t, chunk_bytes):
                data = encode(rows, t.ggml_type).data  # a view: no copy of the block
                out.write(data)
                digest.update(data)
                written += data.nbytes
                progress.advance(data.nbytes)
                del rows, data
                progress.check_abort()
            if written != t.nbytes:
                raise ExportFailed(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            pad = gguf.GGUFWriter.ggml_pad(written, writer.data_alignment) - written
            out.write(bytes(pad))
            digest.update(bytes(pad))
        out.flush()
        os.fsync(out.fileno())
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


# --- verification ------------------------------------------------------------------------------

_FLOAT_REL = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}
"""Half an ulp, relative to each element."""
_BLOCK_REL = {"q8_0": 0.5 / 127 + 2.0**-11, "q4_0": 1 / 8 * (1 + 8 * 2.0**-11)}
"""Worst error relative to the block's largest magnitude: rounding (q8_0: half a step; q4_0: a
whole step, as the value opposite the block's extreme clips at +7) plus the f16 scale's rounding."""
_BLOCK_ABS = {"q8_0": 127 * 2.0**-25, "q4_0": 8 * 2.0**-25}
"""A scale below f16's normal range rounds to a subnormal: absolute error up to 2**-25 per unit."""


def tolerance(src: np.ndarray, type_name: str) -> np.ndarray:
    """Per-element error bound for float32 rows ``src`` stored as ``type_name``."""
    import numpy as np

    if type_name in _FLOAT_REL:
        bound: np.ndarray = (
            np.abs(src) * (_FLOAT_REL[type_name] * 1.001)
            + 1e-30
            + (2.0**-25 if type_name == "f16" else 0.0)
        )
        return bound
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]][0]
    blocks = np.abs(src).reshape(-1, block)
    amax = blocks.max(axis=1, keepdims=True)
    per_block = amax * (_BLOCK_REL[type_name] * 1.001) + _BLOCK_ABS[type_name]
    return np.broadcast_to(per_block, blocks.shape).reshape(src.shape)


@dataclass
class VerifyReport:
    tensors_checked: int = 0
    max_abs_error: dict[str, float] = field(default_factory=dict)
    worst_fraction_of_bound: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensors_checked": self.tensors_checked,
            "max_abs_error": dict(self.max_abs_error),
            "worst_fraction_of_bound": dict(self.worst_fraction_of_bound),
        }


def verify_gguf(
    path: Path,
    plan: GGUFPlan,
    reader: WeightReader,
    progress: Progress,
    chunk_bytes: int = CHUNK_BYTES,
) -> VerifyReport:
    """Read ``path`` back and check every tensor against ``plan`` and the source weights."""
    import gguf

    parsed = gguf.GGUFReader(path, "r")
    arch = parsed.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch is None or arch.contents() != plan.arch_name:
        raise VerificationFailed(f"{path.name}: general.architecture is not {plan.arch_name}")
    found = {
        t.name: (t.tensor_type, [int(d) for d in t.shape], t.n_bytes, t.data_offset)
        for t in parsed.tensors
    }
    del parsed  # drop the memory map; data is read with pread below
    planned = {t.name for t in plan.tensors}
    if set(found) != planned:
        raise VerificationFailed(
            f"{path.name}: tensors differ from plan (missing {sorted(planned - set(found))[:5]},"
            f" unexpected {sorted(set(found) - planned)[:5]})"
        )
    report = VerifyReport()
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in plan.tensors:
            progress.check_abort()
            qtype, ne, nbytes, offset = found[t.name]
            if int(qtype) != t.ggml_type or nbytes != t.nbytes:
                raise VerificationFailed(
                    f"{t.name}: stored as {qtype.name} ({nbytes} bytes), planned {t.type_name}"
                )
            if tuple(reversed(ne)) != tuple(t.shape):
                raise VerificationFailed(f"{t.name}: shape {tuple(reversed(ne))} != {t.shape}")
            _verify_tensor(fd, offset, t, reader, report, progress, chunk_bytes)
            report.tensors_checked += 1
    finally:
        os.close(fd)
    return report


def _stored_blocks(fd: int, offset: int, t: TensorPlan, chunk_bytes: int) -> Iterator[np.ndarray]:
    """The stored tensor, dequantized to float32 row blocks, read with ``pread``."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    per, nrows = _rows_per_block(t.shape, chunk_bytes)
    row_bytes = t.nbytes // nrows
    qtype = GGMLQuantizationType(t.ggml_type)
    for start in range(0, nrows, per):
        rows = min(per, nrows - start)
        pos, length = offset + start * row_bytes, rows * row_bytes
        raw = os.pread(fd, length, pos)
        if len(raw) != length:
            raise VerificationFailed(f"{t.name}: file truncated")
        arr = np.frombuffer(raw, dtype=np.uint8).reshape(rows, row_bytes)
        yield np.asarray(quants.dequantize(arr, qtype), dtype=np.float32).reshape(rows, -1)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, pos, length, os.POSIX_FADV_DONTNEED)


def _verify_tensor(
    fd: int,
    offset: int,
    t: TensorPlan,
    reader: WeightReader,
    report: VerifyReport,
    progress: Progress,
    chunk_bytes: int,
) -> None:
    import numpy as np

    ncols = t.shape[-1] if t.shape else 1
    if t.permute_heads is not None:
        # Undo llama.cpp's permutation on the stored tensor, compare with the untouched source.
        stored_whole = np.concatenate(list(_stored_blocks(fd, offset, t, chunk_bytes)))
        stored_whole = unpermute_qk(stored_whole.reshape(t.shape), t.permute_heads)
        stored: Iterator[np.ndarray] = iter([stored_whole.reshape(-1, ncols)])
        source: Iterator[np.ndarray] = iter(
            [np.concatenate(list(source_blocks(reader, t, chunk_bytes, permuted=False)))]
        )
    else:
        stored = _stored_blocks(fd, offset, t, chunk_bytes)
        source = source_blocks(reader, t, chunk_bytes)
    name = t.type_name
    for src, got in zip(source, stored, strict=True):
        if src.shape != got.shape:
            raise VerificationFailed(f"{t.name}: block shape {got.shape} != source {src.shape}")
        err = np.abs(got - src)
        bound = tolerance(src, name)
        worst = float(np.max(err)) if err.size else 0.0
        ratio = float(np.max(err / np.maximum(bound, 1e-30))) if err.size else 0.0
        bad = ~(err <= bound)  # NaN counts as a failure
        if bad.any():
            raise VerificationFailed(
                f"{t.name}: {int(bad.sum())} elements beyond the {name} tolerance "
                f"(max abs error {worst:.3g})"
            )
        report.max_abs_error[name] = max(report.max_abs_error.get(name, 0.0), worst)
        report.worst_fraction_of_bound[name] = max(
            report.worst_fraction_of_bound.get(name, 0.0), ratio
        )
        progress.advance(src.size * t.nbytes // max(1, math.prod(t.shape)))
