"""Writing a GGUF file one tensor at a time, and reading it back the same way to verify it.

``gguf.GGUFWriter`` keeps every tensor until ``write_tensors_to_file``; here it only lays out the
file: KV metadata and every tensor info (name, shape, type, offset) are known from the plan, so
its header, KV and tensor-info writers run first, then data is streamed through its open file in
row blocks of at most ``chunk_bytes`` (read, permute, convert/quantize, write, free), each tensor
padded to the alignment as ``GGUFWriter.write_tensor_data`` would. The sha256 is computed while
writing. q/k projections are cut at head boundaries, so their permutation needs no more than a
block either: nothing is ever held whole.

Verification reads the file's directory (``gguf_directory``: names, shapes, types, offsets; not
``gguf.GGUFReader``, which costs a minute and 600 MiB on a Llama-3 vocabulary), then each
tensor's bytes with ``os.preadv`` in row blocks, dequantizes them with ``gguf.quants`` and
compares them with the source within the type's error bound.
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
from service.exporters.gguf_directory import read_directory
from service.exporters.gguf_plan import GGUFPlan, TensorPlan, permute_qk, unpermute_qk
from service.heap import HeapTrimmer

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


def block_rows(t: TensorPlan, chunk_bytes: int) -> tuple[int, int, int]:
    """(rows per block, rows, columns) of ``t`` seen as a 2-D matrix of float32 rows.

    A permuted q/k matrix is cut at head boundaries: ``LlamaModel.permute`` only moves rows
    within a head, so each block of whole heads is permuted on its own and nothing is held whole.
    """
    ncols = t.shape[-1] if t.shape else 1
    nrows = math.prod(t.shape) // ncols if ncols else 0
    per = max(1, chunk_bytes // max(1, ncols * 4))
    if t.permute_heads is not None and len(t.shape) >= 2:
        head_rows = t.shape[0] // t.permute_heads
        per = max(1, per // head_rows) * head_rows
    return per, nrows, ncols


def _permute_block(block: np.ndarray, t: TensorPlan, inverse: bool = False) -> np.ndarray:
    """Apply (or undo) the q/k permutation to a block of whole heads."""
    assert t.permute_heads is not None
    fn = unpermute_qk if inverse else permute_qk
    if len(t.shape) == 1:  # a bias: the single row is the whole vector
        return fn(block.reshape(-1), t.permute_heads).reshape(block.shape)
    heads = block.shape[0] // (t.shape[0] // t.permute_heads)
    return fn(block, heads)


def source_blocks(
    reader: WeightReader, tensor: TensorPlan, chunk_bytes: int, permuted: bool = True
) -> Iterator[np.ndarray]:
    """The source tensor as float32 row blocks ``(rows, ncols)``, permuted as planned."""
    import numpy as np
    import torch

    per, _, ncols = block_rows(tensor, chunk_bytes)
    if tensor.values is not None:
        yield np.asarray(tensor.values, dtype=np.float32).reshape(-1, ncols)
        return
    assert tensor.source is not None
    permute = permuted and tensor.permute_heads is not None
    want = per * ncols
    pending: list[np.ndarray] = []
    held = 0
    # Reader chunks of exactly one block when the reader honours max_bytes; any other split
    # (mid-row, several pieces) is reassembled here.
    for chunk in reader.iter_chunks(tensor.source, want * tensor.source_itemsize):
        flat = chunk.reshape(-1).to(torch.float32).numpy()
        pending.append(flat)
        held += flat.size
        while held >= want:
            buf = np.concatenate(pending) if len(pending) > 1 else pending[0]
            block = buf[:want].reshape(-1, ncols)
            yield _permute_block(block, tensor) if permute else block
            rest = buf[want:].copy() if held > want else buf[:0]
            del buf, block
            pending, held = [rest], rest.size
    if held:
        buf = np.concatenate(pending) if len(pending) > 1 else pending[0]
        if held % ncols:
            raise ExportFailed(f"{tensor.source}: reader returned {held} stray elements")
        block = buf.reshape(-1, ncols)
        yield _permute_block(block, tensor) if permute else block


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
        trim = HeapTrimmer()
        for t in plan.tensors:
            progress.check_abort()
            written = 0
            for rows in source_blocks(reader, t, chunk_bytes):
                data = encode(rows, t.ggml_type).data  # a view: no copy of the block
                out.write(data)
                digest.update(data)
                written += data.nbytes
                progress.advance(data.nbytes)
                source_bytes = rows.nbytes
                del rows, data
                trim(source_bytes)  # encoding temporaries fragment the heap
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
    from gguf import GGMLQuantizationType

    directory = read_directory(path)
    arch = directory.metadata.get("general.architecture")
    if arch != plan.arch_name:
        raise VerificationFailed(
            f"{path.name}: general.architecture is {arch!r}, not {plan.arch_name}"
        )
    found = {t.name: t for t in directory.tensors}
    planned = {t.name for t in plan.tensors}
    if set(found) != planned or len(directory.tensors) != len(plan.tensors):
        raise VerificationFailed(
            f"{path.name}: tensors differ from plan (missing {sorted(planned - set(found))[:5]},"
            f" unexpected {sorted(set(found) - planned)[:5]})"
        )
    report = VerifyReport()
    trim = HeapTrimmer()
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in plan.tensors:
            progress.check_abort()
            trim(t.nbytes)  # dequantized blocks of earlier tensors are freed: return their pages
            stored = found[t.name]
            if stored.ggml_type != t.ggml_type:
                kind = GGMLQuantizationType(stored.ggml_type).name
                raise VerificationFailed(f"{t.name}: stored as {kind}, planned {t.type_name}")
            if stored.shape != tuple(t.shape):
                raise VerificationFailed(f"{t.name}: shape {stored.shape} != {t.shape}")
            offset = stored.offset
            _verify_tensor(fd, offset, t, reader, report, progress, chunk_bytes)
            report.tensors_checked += 1
    finally:
        os.close(fd)
    return report


def _stored_blocks(fd: int, offset: int, t: TensorPlan, chunk_bytes: int) -> Iterator[np.ndarray]:
    """The stored tensor, dequantized to float32 row blocks, read with ``pread``."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    per, nrows, _ = block_rows(t, chunk_bytes)
    row_bytes = t.nbytes // nrows
    qtype = GGMLQuantizationType(t.ggml_type)
    for start in range(0, nrows, per):
        rows = min(per, nrows - start)
        pos, length = offset + start * row_bytes, rows * row_bytes
        arr = np.empty((rows, row_bytes), dtype=np.uint8)
        if os.preadv(fd, [arr.data], pos) != length:
            raise VerificationFailed(f"{t.name}: file truncated")
        yield np.asarray(quants.dequantize(arr, qtype), dtype=np.float32).reshape(rows, -1)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, pos, length, os.POSIX_FADV_DONTNEED)


def block_error(src: np.ndarray, got: np.ndarray, type_name: str) -> tuple[float, float]:
    """(max abs error, max error as a fraction of its bound) of ``got`` against ``src``.

    Computed in place in ``got`` to keep a block's verification at about three block sizes.
    """
    import numpy as np

    err = np.subtract(got, src, out=got)
    np.abs(err, out=err)
    worst = float(err.max()) if err.size else 0.0
    if np.isnan(worst):
        return worst, float("inf")
    if type_name in _FLOAT_REL:
        bound = np.abs(src)
        bound *= _FLOAT_REL[type_name] * 1.001
        bound += 1e-30 + (2.0**-25 if type_name == "f16" else 0.0)
        np.divide(err, bound, out=bound)
        return worst, float(bound.max()) if bound.size else 0.0
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]][0]
    amax = np.abs(src).reshape(-1, block).max(axis=1)
    per_block = amax * (_BLOCK_REL[type_name] * 1.001) + _BLOCK_ABS[type_name]
    block_err = err.reshape(-1, block).max(axis=1)
    return worst, float((block_err / per_block).max()) if block_err.size else 0.0


def _verify_tensor(
    fd: int,
    offset: int,
    t: TensorPlan,
    reader: WeightReader,
    report: VerifyReport,
    progress: Progress,
    chunk_bytes: int,
) -> None:
    name = t.type_name
    source = source_blocks(reader, t, chunk_bytes, permuted=False)
    for src, got in zip(source, _stored_blocks(fd, offset, t, chunk_bytes), strict=True):
        if t.permute_heads is not None:
            got = _permute_block(got, t, inverse=True)  # compare in transformers' row order
        if src.shape != got.shape:
            raise VerificationFailed(f"{t.name}: block shape {got.shape} != source {src.shape}")
        worst, fraction = block_error(src, got, name)
        if not fraction <= 1.0:  # NaN fails too
            raise VerificationFailed(
                f"{t.name}: error beyond the {name} tolerance "
                f"(max abs error {worst:.3g}, {fraction:.3g} x the bound)"
            )
        report.max_abs_error[name] = max(report.max_abs_error.get(name, 0.0), worst)
        report.worst_fraction_of_bound[name] = max(
            report.worst_fraction_of_bound.get(name, 0.0), fraction
        )
        progress.advance(src.size * t.nbytes // max(1, math.prod(t.shape)))
        del src, got
