"""A GGUF tensor's source rows in row blocks: how a tensor is cut, and the reading of each block.

The writer (:mod:`writer`) and the read-back (:mod:`verify`) walk a tensor in the same row blocks
of at most ``chunk_bytes`` of float32 (:func:`block_spans`), read from the checkpoint by
:class:`RowBlockReader` (or :func:`source_blocks` for what it does not handle). q/k projections
are cut at head boundaries, so their permutation (:func:`permute_block`, undone by the
read-back) needs no more than a block either: nothing is ever held whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import ExportFailed
from service.exporters.gguf.layout import TensorPlan, permute_qk, unpermute_qk

if TYPE_CHECKING:
    import numpy as np

    from service.checkpoint.base import WeightReader

CHUNK_BYTES = 64 * 1024**2
"""Float32 bytes of one row block: bounds what a tensor costs in memory beyond its source."""


class Progress(Protocol):
    """What the writer reports between row blocks (a ``JobContext`` satisfies it)."""

    def advance(self, n: int) -> None: ...

    def check_abort(self) -> None: ...


Q8_0_BLOCK, Q8_0_BYTES = 32, 34
"""q8_0's layout: values per block, and bytes per block (an f16 scale and 32 int8)."""
PIECE = 256 * 1024
"""Elements encoded, decoded or compared at a time: the temporaries (two float32 pieces) stay in
L2."""


def reused_buffer(buffers: dict[str, Any], key: str, dtype: Any, numel: int) -> Any:
    """A flat torch buffer of at least ``numel`` elements kept in ``buffers`` under ``key``,
    sliced to ``numel``: blocks are read and encoded into the same memory, not fresh pages."""
    import torch

    buf = buffers.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buffers[key] = buf = torch.empty(numel, dtype=dtype)
    return buf[:numel]


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


def block_spans(t: TensorPlan, chunk_bytes: int) -> list[tuple[int, int]]:
    """(first row, rows) of each row block of ``t``, in order; the writer, the source reader
    and the read-back all cut a tensor the same way.

    A stack of experts (``t.parts``) is cut so that no block straddles two experts unless it
    holds whole ones: a block then reads from one expert, or from several whole ones."""
    per, nrows, _ = block_rows(t, chunk_bytes)
    if not t.parts:
        return [(start, min(per, nrows - start)) for start in range(0, nrows, per)]
    part_rows = nrows // len(t.parts)
    if per >= part_rows:
        whole = per // part_rows
        return [
            (i * part_rows, min(whole, len(t.parts) - i) * part_rows)
            for i in range(0, len(t.parts), whole)
        ]
    return [
        (p * part_rows + start, min(per, part_rows - start))
        for p in range(len(t.parts))
        for start in range(0, part_rows, per)
    ]


def _pieces(t: TensorPlan, start: int, rows: int, ncols: int) -> list[tuple[str, int, int]]:
    """(checkpoint tensor, first element, elements) that make up rows ``[start, start+rows)``."""
    if not t.parts:
        assert t.source is not None
        return [(t.source, start * ncols, rows * ncols)]
    part_rows = math.prod(t.shape[1:]) // ncols
    out = []
    row = start
    while row < start + rows:
        index, offset = divmod(row, part_rows)
        take = min(part_rows - offset, start + rows - row)
        out.append((t.parts[index], offset * ncols, take * ncols))
        row += take
    return out


def permute_block(block: np.ndarray, t: TensorPlan, inverse: bool = False) -> np.ndarray:
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

    per, nrows, ncols = block_rows(tensor, chunk_bytes)
    if tensor.values is not None:
        yield np.asarray(tensor.values, dtype=np.float32).reshape(-1, ncols)
        return
    if tensor.compute is not None:
        # llama.cpp's converter transforms this tensor (permute, stack, offset): evaluated once,
        # whole, then handed out in the same row blocks as a read tensor (views, no copies)
        whole = tensor.compute().reshape(-1, ncols)
        for start in range(0, whole.shape[0], per):
            yield whole[start : start + per]
        del whole
        return
    if tensor.parts:
        yield from _part_blocks(reader, tensor, chunk_bytes)
        return
    assert tensor.source is not None
    permute = permuted and tensor.permute_heads is not None
    want = per * ncols
    pending: list[np.ndarray] = []
    held = 0
    left = nrows * ncols  # a plan may keep only the source's first rows (a trimmed vocabulary)
    # Reader chunks of exactly one block when the reader honours max_bytes; any other split
    # (mid-row, several pieces) is reassembled here.
    for chunk in reader.iter_chunks(tensor.source, want * tensor.source_itemsize):
        if left <= 0:
            break
        flat = chunk.reshape(-1)[:left].to(torch.float32).numpy()
        left -= flat.size
        pending.append(flat)
        held += flat.size
        while held >= want:
            buf = np.concatenate(pending) if len(pending) > 1 else pending[0]
            block = buf[:want].reshape(-1, ncols)
            yield permute_block(block, tensor) if permute else block
            rest = buf[want:].copy() if held > want else buf[:0]
            del buf, block
            pending, held = [rest], rest.size
    if held:
        buf = np.concatenate(pending) if len(pending) > 1 else pending[0]
        if held % ncols:
            raise ExportFailed(f"{tensor.source}: reader returned {held} stray elements")
        block = buf.reshape(-1, ncols)
        yield permute_block(block, tensor) if permute else block


def _part_blocks(
    reader: WeightReader, tensor: TensorPlan, chunk_bytes: int
) -> Iterator[np.ndarray]:
    """A stack of experts in row blocks, for readers without ``read_into``: one expert read
    (as float32) at a time, never the stack."""
    import numpy as np
    import torch

    _, _, ncols = block_rows(tensor, chunk_bytes)
    held: tuple[str, np.ndarray] | None = None
    for start, rows in block_spans(tensor, chunk_bytes):
        out = np.empty((rows, ncols), dtype=np.float32)
        flat = out.reshape(-1)
        pos = 0
        for name, first, count in _pieces(tensor, start, rows, ncols):
            if held is None or held[0] != name:
                held = None  # the previous expert goes before the next is read
                held = (name, reader.read(name).reshape(-1).to(torch.float32).numpy())
            flat[pos : pos + count] = held[1][first : first + count]
            pos += count
        yield out
        del out, flat


class RowBlockReader:
    """A tensor's float32 row blocks read into buffers that live as long as the writer.

    ``source_blocks`` allocates a fresh chunk per block: profiled on a 3.7 GB export, page
    faults of fresh buffers and numpy's casts (``writer.BlockEncoder`` has the second half)
    were most of the write. This reads with the reader's ``read_into`` into one buffer per
    dtype. A yielded block is only valid until the next one is asked for. Tensors it does not
    handle (computed ones, readers without ``read_into``) go through :func:`source_blocks`.
    """

    def __init__(
        self,
        reader: WeightReader,
        chunk_bytes: int = CHUNK_BYTES,
        scratch_of: RowBlockReader | None = None,
    ) -> None:
        from service.checkpoint.base import ReadsInto

        self.reader, self.chunk_bytes = reader, chunk_bytes
        self._into = isinstance(reader, ReadsInto)
        self._dtypes = {i.name: i.dtype for i in reader.tensor_infos()}
        for alias, canonical in reader.aliases().items():
            if canonical in self._dtypes:
                self._dtypes.setdefault(alias, self._dtypes[canonical])
        self._buffers: dict[str, Any] = {}
        self._scratch: dict[str, Any] = scratch_of._scratch if scratch_of is not None else {}
        """The source-dtype buffer a block is read into before its float32 cast: filled and
        emptied within one block, so a second reader of the same source shares it."""
        self.drop_pages: bool | None = None
        """None: the reader's own ``drop_page_cache``; else what it is set to for this one's
        reads (the writer leaves a block's pages cached for the read-back's second read)."""

    def _read_into(self, name: str, first: int, out: Any) -> None:
        """``reader.read_into`` with the page-cache policy of :attr:`drop_pages`."""
        flag = getattr(self.reader, "drop_page_cache", None)
        if self.drop_pages is None or not isinstance(flag, bool) or flag == self.drop_pages:
            self.reader.read_into(name, first, out)  # type: ignore[attr-defined]
            return
        self.reader.drop_page_cache = self.drop_pages  # type: ignore[attr-defined]
        try:
            self.reader.read_into(name, first, out)  # type: ignore[attr-defined]
        finally:
            self.reader.drop_page_cache = flag  # type: ignore[attr-defined]

    def fast(self, t: TensorPlan) -> bool:
        """Whether ``t`` is read with ``read_into`` (a plain renamed checkpoint tensor)."""
        names = t.parts or ((t.source,) if t.source is not None else ())
        return (
            self._into
            and bool(names)
            and t.values is None
            and getattr(t, "compute", None) is None
            and all(n in self._dtypes for n in names)
        )

    def blocks(self, t: TensorPlan, permuted: bool = True) -> Iterator[np.ndarray]:
        """``t`` as float32 row blocks ``(rows, ncols)``, permuted as planned when asked."""
        import torch

        if not self.fast(t):
            yield from source_blocks(self.reader, t, self.chunk_bytes, permuted)
            return
        _, _, ncols = block_rows(t, self.chunk_bytes)
        permute = permuted and t.permute_heads is not None
        for start, rows in block_spans(t, self.chunk_bytes):
            n = rows * ncols
            f32 = reused_buffer(self._buffers, "f32", torch.float32, n)
            pos = 0
            for name, first, count in _pieces(t, start, rows, ncols):
                dtype = self._dtypes[name]
                if dtype == torch.float32:
                    self._read_into(name, first, f32[pos : pos + count])
                else:
                    raw = reused_buffer(self._scratch, "raw", dtype, count)
                    self._read_into(name, first, raw)
                    f32[pos : pos + count].copy_(raw)
                pos += count
            block = f32.numpy().reshape(rows, ncols)
            yield permute_block(block, t) if permute else block


class torch_threads:
    """Run torch's kernels on ``n`` threads inside the block.

    The casts run on row blocks between reads and writes; OpenMP's worker threads on a busy
    2-core machine spin at each kernel's barrier (measured: q8_0 15x slower with 2 threads
    than with 1 under load), and the second core already writes and hashes.
    """

    def __init__(self, n: int) -> None:
        self.n, self.before = n, 0

    def __enter__(self) -> None:
        import torch

        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.before)
