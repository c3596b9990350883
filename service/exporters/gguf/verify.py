"""A GGUF file checked against its plan and its source: the layout, and every tensor read back.

Verification reads the file's directory (``directory``: names, shapes, types, offsets; not
``gguf.GGUFReader``, which costs a minute and 600 MiB on a Llama-3 vocabulary), then each
tensor's bytes with ``os.preadv`` in the row blocks the writer wrote (``blocks.block_spans``),
dequantizes them (f32/f16/q8_0 with torch, others with ``gguf.quants``) and compares them with
the source within the type's error bound (``_FLOAT_REL``, ``_BLOCK_REL``, ``_BLOCK_ABS``),
undoing the q/k permutation the writer applied (``blocks.permute_block``).

An export reads its blocks back as it writes them (:class:`WrittenCheck`, driven by
``writer.write_gguf_files(check=...)``): one block behind the writer thread, from the file while
its pages are still cached, against the source's rows read again in the checkpoint's order (the
writer leaves a block's source pages cached until then), so the read-back reads neither the disk
a second time nor anything the writer produced. :func:`verify_gguf` reads a finished file back
the same way, or with ``read_back=False`` checks only its layout.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import VerificationFailed
from service.exporters.gguf.blocks import (
    CHUNK_BYTES,
    PIECE,
    Q8_0_BLOCK,
    Q8_0_BYTES,
    Progress,
    RowBlockReader,
    block_rows,
    block_spans,
    permute_block,
    torch_threads,
)
from service.exporters.gguf.directory import GGUFDirectory, read_directory
from service.exporters.gguf.layout import GGUFPlan, TensorPlan
from service.memory.heap import HeapTrimmer

if TYPE_CHECKING:
    import numpy as np

    from service.checkpoint.base import WeightReader

_FLOAT_REL = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}
"""Half an ulp, relative to each element."""
_BLOCK_REL = {"q8_0": 0.5 / 127 + 2.0**-11, "q4_0": 1 / 8 * (1 + 8 * 2.0**-11)}
"""Worst error relative to the block's largest magnitude: rounding (q8_0: half a step; q4_0: a
whole step, as the value opposite the block's extreme clips at +7) plus the f16 scale's rounding."""
_BLOCK_ABS = {"q8_0": 127 * 2.0**-25, "q4_0": 8 * 2.0**-25}
"""A scale below f16's normal range rounds to a subnormal: absolute error up to 2**-25 per unit."""


@dataclass
class VerifyReport:
    """The read-back's figures, the manifest's ``verification`` section of a GGUF export."""

    tensors_checked: int = 0
    max_abs_error: dict[str, float] = field(default_factory=dict)
    worst_fraction_of_bound: dict[str, float] = field(default_factory=dict)
    read_back: bool = True
    """False when only the file's layout was checked (a job with ``"verify": false``)."""
    files: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "read_back": self.read_back,
            "files": self.files,
            "tensors_checked": self.tensors_checked,
            "max_abs_error": dict(self.max_abs_error),
            "worst_fraction_of_bound": dict(self.worst_fraction_of_bound),
        }


def verify_gguf(
    path: Path | Sequence[Path],
    plan: GGUFPlan,
    reader: WeightReader,
    progress: Progress,
    chunk_bytes: int = CHUNK_BYTES,
    read_back: bool = True,
) -> VerifyReport:
    """Check the file (or llama.cpp split files, first to last) against ``plan``: layout always,
    and with ``read_back`` every tensor's data against the source weights.

    The layout check reads only the headers (names, shapes, types, split keys), so it costs
    nothing; the read-back reads every byte of the file and of the source again.
    """
    from gguf import GGMLQuantizationType

    paths = [path] if isinstance(path, Path) else list(path)
    directories = [read_directory(p) for p in paths]
    _check_splits(paths, directories, len(plan.tensors))
    arch = directories[0].metadata.get("general.architecture")
    if arch != plan.arch_name:
        raise VerificationFailed(
            f"{paths[0].name}: general.architecture is {arch!r}, not {plan.arch_name}"
        )
    found = {t.name: (i, t) for i, d in enumerate(directories) for t in d.tensors}
    planned = {t.name for t in plan.tensors}
    stored_count = sum(len(d.tensors) for d in directories)
    if set(found) != planned or stored_count != len(plan.tensors):
        raise VerificationFailed(
            f"{paths[0].name}: tensors differ from plan (missing "
            f"{sorted(planned - set(found))[:5]}, unexpected {sorted(set(found) - planned)[:5]})"
        )
    for t in plan.tensors:
        stored = found[t.name][1]
        if stored.ggml_type != t.ggml_type:
            kind = GGMLQuantizationType(stored.ggml_type).name
            raise VerificationFailed(f"{t.name}: stored as {kind}, planned {t.type_name}")
        if stored.shape != tuple(t.shape):
            raise VerificationFailed(f"{t.name}: shape {stored.shape} != {t.shape}")
    report = VerifyReport(read_back=read_back, files=len(paths))
    if not read_back:
        return report
    trim = HeapTrimmer()
    source = RowBlockReader(reader, chunk_bytes)
    stored_reader = _StoredBlocks(chunk_bytes)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        with torch_threads(1):
            for t in plan.tensors:
                progress.check_abort()
                trim(t.nbytes)  # dequantized blocks of earlier tensors are freed: return their pages
                index, stored = found[t.name]
                stored_blocks = stored_reader.blocks(fds[index], stored.offset, t)
                _verify_tensor(source.blocks(t, permuted=False), stored_blocks, t, report, progress)
                report.tensors_checked += 1
    finally:
        for fd in fds:
            os.close(fd)
    return report


def _check_splits(paths: list[Path], directories: list[GGUFDirectory], n_tensors: int) -> None:
    """Split files carry ``split.no`` (their index), ``split.count`` and ``split.tensors.count``
    as llama.cpp's loader checks them; a single file carries none or a count of 1."""
    if len(paths) == 1:
        count = directories[0].metadata.get("split.count", 1)
        if count != 1:
            raise VerificationFailed(f"{paths[0].name}: split.count is {count}, one file given")
        return
    for i, (p, d) in enumerate(zip(paths, directories, strict=True)):
        got = tuple(d.metadata.get(k) for k in ("split.no", "split.count", "split.tensors.count"))
        if got != (i, len(paths), n_tensors):
            raise VerificationFailed(
                f"{p.name}: split keys (no, count, tensors.count) are {got}, "
                f"expected {(i, len(paths), n_tensors)}"
            )


class _StoredBlocks:
    """A stored tensor dequantized to float32 row blocks, read with ``pread`` into reused
    buffers (f32/f16 are cast by torch; other types by ``gguf.quants``)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._raw: Any = None
        self._f32: Any = None

    def blocks(self, fd: int, offset: int, t: TensorPlan) -> Iterator[np.ndarray]:
        """``t``'s row blocks as :func:`block_spans` cuts them, from the tensor's data at
        ``offset``; each block's pages leave the page cache once decoded."""
        _, nrows, _ = block_rows(t, self.chunk_bytes)
        row_bytes = t.nbytes // nrows
        for start, rows in block_spans(t, self.chunk_bytes):
            pos, length = offset + start * row_bytes, rows * row_bytes
            yield self.read(fd, pos, length, rows, t)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, pos, length, os.POSIX_FADV_DONTNEED)

    def read(self, fd: int, pos: int, length: int, rows: int, t: TensorPlan) -> np.ndarray:
        """``rows`` rows of ``t`` stored in the ``length`` bytes at ``pos``, as float32 (valid
        until the next read)."""
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType, quants

        _, _, ncols = block_rows(t, self.chunk_bytes)
        if self._raw is None or self._raw.numel() < length:
            self._raw = torch.empty(length, dtype=torch.uint8)
        raw = self._raw[:length]
        view = memoryview(raw.numpy().data).cast("B")
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:]], pos + done)
            if n == 0:
                raise VerificationFailed(f"{t.name}: file truncated")
            done += n
        if t.type_name in ("f32", "f16", "q8_0"):
            if self._f32 is None or self._f32.numel() < rows * ncols:
                self._f32 = torch.empty(rows * ncols, dtype=torch.float32)
            f32 = self._f32[: rows * ncols]
            if t.type_name == "q8_0":
                _dequantize_q8_0(raw, f32)
            else:
                f32.copy_(raw.view(torch.float32 if t.type_name == "f32" else torch.float16))
            out: np.ndarray = f32.numpy().reshape(rows, ncols)
            return out
        arr = raw.numpy().reshape(rows, length // rows)
        qtype = GGMLQuantizationType(t.ggml_type)
        return np.asarray(quants.dequantize(arr, qtype), dtype=np.float32).reshape(rows, -1)


def _dequantize_q8_0(raw: Any, out: Any) -> None:
    """q8_0 blocks (``raw``, uint8) decoded into ``out`` (float32) as ``gguf.quants.Q8_0``
    does, each int8 times its block's f16 scale in float32 (bit-identical: tested), in pieces
    that stay in cache; numpy's decode was the read-back's largest cost on a q8_0 export."""
    import torch

    blocks = raw.view(-1, Q8_0_BYTES)
    values = out.view(-1, Q8_0_BLOCK)
    step = PIECE // Q8_0_BLOCK
    for b0 in range(0, blocks.shape[0], step):
        piece = blocks[b0 : b0 + step]
        scales = piece[:, :2].contiguous().view(torch.float16).to(torch.float32)
        torch.mul(piece[:, 2:].view(torch.int8), scales, out=values[b0 : b0 + step])


def block_error(src: np.ndarray, got: np.ndarray, type_name: str) -> tuple[float, float]:
    """(max abs error, max error as a fraction of its bound) of ``got`` against ``src``.

    Computed in place in ``got`` (overwritten), :data:`PIECE` elements at a time with one
    piece of scratch: each of the comparison's passes (difference, magnitude, bound, ratio,
    maxima) then runs over a piece that stays in cache, not over the whole block in memory.
    Measured on a 64 MiB f16 block: 71 ms whole, 33 ms by pieces; the read-back runs once per
    block of the file, so this was half of a verified export's read-back.
    """
    import numpy as np

    flat_src, flat_got = src.reshape(-1), got.reshape(-1)
    if flat_src.size == 0:
        return 0.0, 0.0
    floating = type_name in _FLOAT_REL
    if floating:
        rel = _FLOAT_REL[type_name] * 1.001
        floor = 1e-30 + (2.0**-25 if type_name == "f16" else 0.0)
        block = 1
    else:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]][0]
        rel, floor = _BLOCK_REL[type_name] * 1.001, _BLOCK_ABS[type_name]
    piece = max(block, PIECE // block * block)  # whole quantization blocks per piece
    scratch = np.empty(min(piece, flat_src.size), dtype=np.float32)
    worst = fraction = 0.0
    for start in range(0, flat_src.size, piece):
        s, err = flat_src[start : start + piece], flat_got[start : start + piece]
        np.subtract(err, s, out=err)
        np.abs(err, out=err)
        w = float(err.max())
        if np.isnan(w):
            return w, float("inf")
        bound = scratch[: s.size]
        np.abs(s, out=bound)
        if floating:
            bound *= rel
            bound += floor
            np.divide(err, bound, out=bound)
            f = float(bound.max())
        else:
            amax = bound.reshape(-1, block).max(axis=1)
            amax *= rel
            amax += floor
            f = float((err.reshape(-1, block).max(axis=1) / amax).max())
        worst = max(worst, w)
        if np.isnan(f):  # an infinite source element: fails, as the whole block's ratio did
            return worst, f
        fraction = max(fraction, f)
    return worst, fraction


def _verify_tensor(
    source: Iterator[np.ndarray],
    stored: Iterator[np.ndarray],
    t: TensorPlan,
    report: VerifyReport,
    progress: Progress,
) -> None:
    for src, got in zip(source, stored, strict=True):
        if t.permute_heads is not None:
            got = permute_block(got, t, inverse=True)  # compare in transformers' row order
        _check_block(src, got, t, report, progress)
        del src, got


def _check_block(
    src: np.ndarray, got: np.ndarray, t: TensorPlan, report: VerifyReport, progress: Progress
) -> None:
    """One stored block (``got``, decoded; overwritten) against its source rows ``src``."""
    name = t.type_name
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


# --- the read-back while writing ---------------------------------------------------------------


class WrittenBytes(Protocol):
    """What the read-back waits on: the writer thread's bytes reaching the file."""

    def wait_written(self, nbytes: int) -> None: ...


class WrittenCheck:
    """The read-back of ``writer.write_gguf_files`` with ``check``: one block behind the writer.

    :meth:`submit` hands over the block just given to the writer thread and checks the one
    before it: it waits until the writer has put that block's bytes in the file, reads them
    back with ``pread`` from the file's own descriptor, decodes them and compares them with the
    source. A checkpoint tensor's rows are read again from the source (``source``, in the
    checkpoint's order: a permuted q/k block is unpermuted after decoding), so nothing the
    writer did to them is taken on trust. A tensor llama.cpp's converter computed has no
    source rows but the converter's: it is compared with the rows it was encoded from.
    """

    def __init__(
        self,
        file: Path,
        data_start: int,
        sink: WrittenBytes,
        report: VerifyReport,
        progress: Progress,
        source: RowBlockReader,
    ) -> None:
        self._fd = os.open(file, os.O_RDONLY)
        self._start, self._sink, self._report, self._progress = data_start, sink, report, progress
        self._source = source
        self._stored = _StoredBlocks(source.chunk_bytes)
        self._pending: tuple[TensorPlan, np.ndarray | None, int, int] | None = None
        self._current: tuple[str, Iterator[np.ndarray] | None] | None = None

    def submit(
        self, t: TensorPlan | None, rows: np.ndarray | None, offset: int, length: int
    ) -> None:
        """Keep this block (``t``'s ``rows``, ``length`` bytes at ``offset`` after the header)
        and check the previous one; ``t`` None: only check the previous one."""
        pending, self._pending = self._pending, None
        if t is not None and rows is not None:
            # a checkpoint tensor's rows are read again at its check: the writer's are let go
            self._pending = (t, None if self._source.fast(t) else rows, offset, length)
        if pending is None:
            return
        tensor, written_from, at, size = pending
        if self._current is None or self._current[0] != tensor.name:
            again = self._source.blocks(tensor, permuted=False) if written_from is None else None
            self._current = (tensor.name, again)
            self._report.tensors_checked += 1
        again = self._current[1]
        src = written_from if again is None else next(again, None)
        if src is None:
            raise VerificationFailed(f"{tensor.name}: more row blocks written than the source has")
        self._sink.wait_written(at + size)
        got = self._stored.read(self._fd, self._start + at, size, src.shape[0], tensor)
        if again is not None and tensor.permute_heads is not None:
            got = permute_block(got, tensor, inverse=True)  # compare in the checkpoint's order
        _check_block(src, got, tensor, self._report, self._progress)

    def close(self) -> None:
        self._pending = self._current = None
        os.close(self._fd)
