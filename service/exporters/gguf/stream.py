"""Writing a GGUF file one tensor at a time, and reading it back the same way to verify it.

``gguf.GGUFWriter`` keeps every tensor until ``write_tensors_to_file``; here it only lays out the
file: KV metadata and every tensor info (name, shape, type, offset) are known from the plan, so
its header, KV and tensor-info writers run first, then data is streamed through its open file in
row blocks of at most ``chunk_bytes`` (read, permute, convert/quantize, write, free), each tensor
padded to the alignment as ``GGUFWriter.write_tensor_data`` would. The sha256 is computed while
writing. q/k projections are cut at head boundaries, so their permutation needs no more than a
block either: nothing is ever held whole.

Verification reads the file's directory (``directory``: names, shapes, types, offsets; not
``gguf.GGUFReader``, which costs a minute and 600 MiB on a Llama-3 vocabulary), then each
tensor's bytes with ``os.preadv`` in row blocks, dequantizes them with ``gguf.quants`` and
compares them with the source within the type's error bound. An export reads its blocks back
as it writes them (``write_gguf_files(check=...)``): one block behind the writer thread, from
the file while its pages are still cached, against the source's rows read again in the
checkpoint's order (the writer leaves a block's source pages cached until then), so the
read-back reads neither the disk a second time nor anything the writer produced.

Why one module of over 450 lines: writing and verifying are one plan read two ways. The verifier
walks the row blocks the writer wrote (:func:`block_spans`, :class:`RowBlockReader`) and undoes
the q/k permutation the writer applied (:func:`_permute_block`), so the two halves change
together (and the export's read-back runs inside the writer's loop); split, those private
helpers would become a second module's API only to keep them in step. The per-type error bounds
(``_FLOAT_REL``, ``_BLOCK_REL``, ``_BLOCK_ABS``) are the verifier's half.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import ExportFailed, VerificationFailed
from service.exporters.gguf.directory import GGUFDirectory, read_directory
from service.exporters.gguf.layout import GGUFPlan, TensorPlan, permute_qk, unpermute_qk
from service.memory.heap import HeapTrimmer

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


def encode(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """Float32 rows in the tensor's storage type, as ``gguf.quants.quantize`` encodes them."""
    from gguf import GGMLQuantizationType, quants

    encoded: np.ndarray = quants.quantize(rows, GGMLQuantizationType(ggml_type))
    return encoded


_Q8_0_BLOCK, _Q8_0_BYTES = 32, 34
_PIECE = 256 * 1024
"""Elements quantized at a time: the q8_0 temporaries (two float32 pieces) stay in L2."""


class RowBlockReader:
    """A tensor's float32 row blocks read into buffers that live as long as the writer.

    ``source_blocks`` allocates a fresh chunk per block and numpy's float16 cast and q8_0 run at
    300 MB/s and 120 MB/s here: profiled on a 3.7 GB export, page faults of fresh buffers and
    those two casts were most of the write. This reads with the reader's ``read_into`` into
    one buffer per dtype and encodes f32/f16/q8_0 with torch into a reused output buffer
    (bit-identical to ``gguf.quants``: tested). A yielded block is only valid until the next
    one is asked for. Tensors it does not handle (computed ones, readers without
    ``read_into``) go through :func:`source_blocks`.
    """

    FAST_TYPES = frozenset({"f32", "f16", "q8_0"})

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

    def _buffer(self, key: str, dtype: Any, numel: int, pool: dict[str, Any] | None = None) -> Any:
        """A reused flat torch buffer of at least ``numel`` elements, sliced to ``numel``."""
        import torch

        buffers = self._buffers if pool is None else pool
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buffers[key] = buf = torch.empty(numel, dtype=dtype)
        return buf[:numel]

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
            f32 = self._buffer("f32", torch.float32, n)
            pos = 0
            for name, first, count in _pieces(t, start, rows, ncols):
                dtype = self._dtypes[name]
                if dtype == torch.float32:
                    self._read_into(name, first, f32[pos : pos + count])
                else:
                    raw = self._buffer("raw", dtype, count, self._scratch)
                    self._read_into(name, first, raw)
                    f32[pos : pos + count].copy_(raw)
                pos += count
            block = f32.numpy().reshape(rows, ncols)
            yield _permute_block(block, t) if permute else block

    def encode(self, rows: np.ndarray, ggml_type: int, type_name: str, slot: int = 0) -> memoryview:
        """``rows`` in the storage type, as bytes in output buffer ``slot`` (valid until that
        slot is encoded into again; never a view of ``rows``)."""
        import torch

        if type_name not in self.FAST_TYPES:
            return memoryview(encode(rows, ggml_type).data).cast("B")
        import numpy as np

        src = torch.from_numpy(np.ascontiguousarray(rows)).reshape(-1)  # no copy when it is
        if type_name == "q8_0":
            return memoryview(self._q8_0(src, slot).numpy().data).cast("B")
        dtype = torch.float32 if type_name == "f32" else torch.float16
        out = self._buffer(f"out{slot}", dtype, src.numel()).copy_(src)
        return memoryview(out.numpy().data).cast("B")

    def _q8_0(self, src: Any, slot: int) -> Any:
        """ggml's ``quantize_row_q8_0_ref`` (as ``gguf.quants.Q8_0``), in float32 like it."""
        import torch

        nblocks = src.numel() // _Q8_0_BLOCK
        out = self._buffer(f"out{slot}", torch.uint8, nblocks * _Q8_0_BYTES)
        out = out.view(nblocks, _Q8_0_BYTES)
        scales = out[:, :2].view(torch.float16)
        quants = out[:, 2:].view(torch.int8)
        blocks = src.view(nblocks, _Q8_0_BLOCK)
        step = _PIECE // _Q8_0_BLOCK
        a = self._buffer("q8a", torch.float32, _PIECE)
        f = self._buffer("q8f", torch.float32, _PIECE)
        for b0 in range(0, nblocks, step):
            b1 = min(nblocks, b0 + step)
            x = blocks[b0:b1]
            s = a[: x.numel()].view(b1 - b0, _Q8_0_BLOCK)
            fl = f[: x.numel()].view(b1 - b0, _Q8_0_BLOCK)
            torch.abs(x, out=s)
            d = s.amax(dim=1, keepdim=True).div_(127)
            inv = torch.where(d == 0, torch.zeros_like(d), d.reciprocal())
            torch.mul(x, inv, out=s)  # x * id
            sign = torch.sign(s)
            s.abs_()
            torch.floor(s, out=fl)  # np_roundf: floor(a) + floor(2 * (a - floor(a)))
            s.sub_(fl).mul_(2).floor_().add_(fl).mul_(sign)
            quants[b0:b1].copy_(s)
            scales[b0:b1].copy_(d)
        return out


# --- writing -----------------------------------------------------------------------------------


class _HashingWriter:
    """Writes and hashes blocks in a second thread while the caller encodes the next one.

    ``write`` and ``sha256`` release the GIL, so on two cores they overlap the read and the
    cast (profiled: hashing alone was a quarter of an f16 write). Two output slots alternate:
    the caller takes a slot (waiting until its previous block is on disk), encodes into it and
    hands it over. An error in the thread (disk full) is raised at the caller's next call.
    Each block is flushed to the file as it is written, and :meth:`wait_written` waits until
    the file holds a given number of bytes: what the caller reads back of it is the file's.
    """

    SLOTS = 2

    def __init__(self, out: Any, digest: Any) -> None:
        import queue
        import threading

        self._out, self._digest = out, digest
        self._written = 0
        self._progress = threading.Condition()
        self._free = [threading.Semaphore(1) for _ in range(self.SLOTS)]
        self._queue: queue.Queue[tuple[memoryview, int] | None] = queue.Queue(self.SLOTS)
        self._error: BaseException | None = None
        self._next = 0
        self._thread = threading.Thread(target=self._run, name="gguf-writer", daemon=True)
        self._thread.start()

    def take_slot(self) -> int:
        """The slot to encode the next block into, once the writer is done with it."""
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        self._free[slot].acquire()
        self._raise()
        return slot

    def put(self, data: memoryview, slot: int) -> None:
        self._raise()
        self._queue.put((data, slot))

    def wait_written(self, nbytes: int) -> None:
        """Wait until ``nbytes`` of the handed-over blocks are in the file (flushed to the
        kernel: a ``pread`` of them reads what was written); raise what the thread raised."""
        with self._progress:
            while self._written < nbytes and self._error is None:
                self._progress.wait()
        self._raise()

    def close(self) -> None:
        """Wait for every block handed over; raise what the thread raised."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            data, slot = item
            try:
                if self._error is None:
                    self._out.write(data)
                    self._out.flush()
                    self._digest.update(data)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                self._error = exc
            finally:
                with self._progress:
                    self._written += len(data)
                    self._progress.notify_all()
                del data, item
                self._free[slot].release()


def write_gguf(
    path: Path,
    plan: GGUFPlan,
    reader: WeightReader,
    add_metadata: Callable[[GGUFWriter], None],
    progress: Progress,
    chunk_bytes: int = CHUNK_BYTES,
    check: VerifyReport | None = None,
) -> str:
    """Write ``plan`` to ``path`` atomically; returns the file's sha256 (``check``: as
    :func:`write_gguf_files`)."""
    digests = write_gguf_files(path, plan, reader, add_metadata, progress, chunk_bytes, check=check)
    return digests[path.name]


def write_gguf_files(
    path: Path,
    plan: GGUFPlan,
    reader: WeightReader,
    add_metadata: Callable[[GGUFWriter], None],
    progress: Progress,
    chunk_bytes: int = CHUNK_BYTES,
    max_shard_bytes: int | None = None,
    check: VerifyReport | None = None,
) -> dict[str, str]:
    """Write ``plan`` as ``path``, or beyond ``max_shard_bytes`` of tensor data as llama.cpp's
    split files beside it; returns {file name: sha256}.

    With ``check``, every row block is read back from the file once the writer thread has
    written it (``pread`` of the file, what llama.cpp will map), decoded and compared with the
    source's rows within the type's error bound (the figures go into ``check``; beyond the
    bound :class:`VerificationFailed` naming the tensor). The source rows are read again, in
    the checkpoint's row order, not taken from the writer: a writer that misplaces, permutes
    or alters rows before encoding them is caught by the tensor's name. The writer leaves each
    block's source pages cached until that second read, and the written bytes are still in
    the page cache, so the check reads nothing from the disk, and it runs on the main thread
    while the writer thread writes the next block. :func:`verify_gguf` with
    ``read_back=False`` then checks the files' layout.

    Splits are ``gguf.GGUFWriter``'s (what ``convert_hf_to_gguf --split-max-size`` and
    ``llama-gguf-split`` write): ``<stem>-00001-of-0000N.gguf``, every file a GGUF with its own
    tensor infos and ``split.no``/``split.count``/``split.tensors.count``, the model's metadata
    in the first; a tensor larger than the limit gets a file of its own. The files are written
    in a hidden directory beside ``path`` and renamed into place only when all are complete.
    """
    import shutil

    import gguf
    import numpy as np

    staging = path.parent / f".{path.name}.part"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writer = gguf.GGUFWriter(None, plan.arch_name, split_max_size=max_shard_bytes or 0)
    add_metadata(writer)
    for t in plan.tensors:
        writer.add_tensor_info(
            t.name,
            t.shape,
            np.dtype(np.float32),
            t.nbytes,
            raw_dtype=gguf.GGMLQuantizationType(t.ggml_type),
        )
    files = writer.format_shard_names(staging / path.name)
    digests: dict[str, str] = {}
    try:
        writer.write_header_to_file(path=staging / path.name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None and len(writer.fout) == len(files)
        by_name = {t.name: t for t in plan.tensors}
        blocks = RowBlockReader(reader, chunk_bytes)
        with _torch_threads(1):
            for file, out, tensors in zip(files, writer.fout, writer.tensors, strict=True):
                digests[file.name] = _write_data(
                    file, out, [by_name[n] for n in tensors], blocks, writer, progress, check
                )
        if check is not None:
            check.files = len(files)
        writer.close()
        for file in files:
            os.replace(file, path.parent / file.name)
    except BaseException:
        writer.close()
        for file in files:
            (path.parent / file.name).unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return digests


def _write_data(
    file: Path,
    out: Any,
    tensors: list[TensorPlan],
    blocks: RowBlockReader,
    writer: GGUFWriter,
    progress: Progress,
    check: VerifyReport | None = None,
) -> str:
    """Stream ``tensors`` into ``out`` (header already written), fsync; returns the sha256.
    With ``check``, each block is read back and checked as it is written (:class:`_WrittenCheck`)."""
    import gguf

    writer.write_padding(out, out.tell())
    out.flush()
    digest = hashlib.sha256()
    with open(file, "rb") as head:
        digest.update(head.read(out.tell()))
    trim = HeapTrimmer()
    sink = _HashingWriter(out, digest)
    checker = None
    if check is not None:
        source = RowBlockReader(blocks.reader, blocks.chunk_bytes, scratch_of=blocks)
        checker = _WrittenCheck(file, out.tell(), sink, check, progress, source)
        blocks.drop_pages = False  # the check's second read of the block drops them
    pos = 0  # bytes handed to the writer after the header
    try:
        for t in tensors:
            progress.check_abort()
            written = 0
            for rows in blocks.blocks(t):
                slot = sink.take_slot()
                data = blocks.encode(rows, t.ggml_type, t.type_name, slot)
                sink.put(data, slot)
                if checker is not None:
                    checker.submit(t, rows, pos, data.nbytes)  # and checks the one before
                written += data.nbytes
                pos += data.nbytes
                progress.advance(data.nbytes)
                source_bytes = rows.nbytes
                del rows, data
                trim(source_bytes)  # permuted copies and encoding temporaries fragment the heap
                progress.check_abort()
            if written != t.nbytes:
                raise ExportFailed(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            pad = gguf.GGUFWriter.ggml_pad(written, writer.data_alignment) - written
            if pad:
                sink.put(memoryview(bytes(pad)), sink.take_slot())
                pos += pad
        if checker is not None:
            checker.submit(None, None, pos, 0)  # the last block
    finally:
        sink.close()
        blocks.drop_pages = None
        if checker is not None:
            checker.close()
    out.flush()
    os.fsync(out.fileno())
    return digest.hexdigest()


class _WrittenCheck:
    """The read-back of :func:`write_gguf_files` with ``check``: one block behind the writer.

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
        sink: _HashingWriter,
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
            got = _permute_block(got, tensor, inverse=True)  # compare in the checkpoint's order
        _check_block(src, got, tensor, self._report, self._progress)

    def close(self) -> None:
        self._pending = self._current = None
        os.close(self._fd)


class _torch_threads:
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
        with _torch_threads(1):
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

    blocks = raw.view(-1, _Q8_0_BYTES)
    values = out.view(-1, _Q8_0_BLOCK)
    step = _PIECE // _Q8_0_BLOCK
    for b0 in range(0, blocks.shape[0], step):
        piece = blocks[b0 : b0 + step]
        scales = piece[:, :2].contiguous().view(torch.float16).to(torch.float32)
        torch.mul(piece[:, 2:].view(torch.int8), scales, out=values[b0 : b0 + step])


def block_error(src: np.ndarray, got: np.ndarray, type_name: str) -> tuple[float, float]:
    """(max abs error, max error as a fraction of its bound) of ``got`` against ``src``.

    Computed in place in ``got`` (overwritten), :data:`_PIECE` elements at a time with one
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
    piece = max(block, _PIECE // block * block)  # whole quantization blocks per piece
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
            got = _permute_block(got, t, inverse=True)  # compare in transformers' row order
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
