"""Writing a GGUF file one tensor at a time, in row blocks, never holding a tensor whole.

``gguf.GGUFWriter`` keeps every tensor until ``write_tensors_to_file``; here it only lays out the
file: KV metadata and every tensor info (name, shape, type, offset) are known from the plan, so
its header, KV and tensor-info writers run first, then data is streamed through its open file in
row blocks of at most ``chunk_bytes`` (``blocks``: read, permute; here: convert/quantize, write,
free), each tensor padded to the alignment as ``GGUFWriter.write_tensor_data`` would. The sha256
is computed while writing. With ``check``, each block is read back from the file as it is written
(``verify.WrittenCheck``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import ExportFailed
from service.exporters.gguf.blocks import (
    CHUNK_BYTES,
    PIECE,
    Q8_0_BLOCK,
    Q8_0_BYTES,
    Progress,
    RowBlockReader,
    reused_buffer,
    torch_threads,
)
from service.exporters.gguf.layout import GGUFPlan, TensorPlan
from service.exporters.gguf.verify import VerifyReport, WrittenCheck
from service.memory.heap import HeapTrimmer

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFWriter

    from service.checkpoint.base import WeightReader


def encode(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """Float32 rows in the tensor's storage type, as ``gguf.quants.quantize`` encodes them."""
    from gguf import GGMLQuantizationType, quants

    encoded: np.ndarray = quants.quantize(rows, GGMLQuantizationType(ggml_type))
    return encoded



class BlockEncoder:
    """Float32 row blocks in their storage type, encoded into output buffers reused block after
    block.

    numpy's float16 cast and q8_0 run at 300 MB/s and 120 MB/s here: profiled on a 3.7 GB
    export, those two casts and the page faults of fresh buffers (``blocks.RowBlockReader`` has
    the second half) were most of the write. This encodes f32/f16/q8_0 with torch into a reused
    output buffer (bit-identical to ``gguf.quants``: tested); other types go through
    ``gguf.quants`` (:func:`encode`).
    """

    FAST_TYPES = frozenset({"f32", "f16", "q8_0"})

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}

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
        out = reused_buffer(self._buffers, f"out{slot}", dtype, src.numel()).copy_(src)
        return memoryview(out.numpy().data).cast("B")


    def _q8_0(self, src: Any, slot: int) -> Any:
        """ggml's ``quantize_row_q8_0_ref`` (as ``gguf.quants.Q8_0``), in float32 like it."""
        import torch

        nblocks = src.numel() // Q8_0_BLOCK
        out = reused_buffer(self._buffers, f"out{slot}", torch.uint8, nblocks * Q8_0_BYTES)
        out = out.view(nblocks, Q8_0_BYTES)
        scales = out[:, :2].view(torch.float16)
        quants = out[:, 2:].view(torch.int8)
        blocks = src.view(nblocks, Q8_0_BLOCK)
        step = PIECE // Q8_0_BLOCK
        a = reused_buffer(self._buffers, "q8a", torch.float32, PIECE)
        f = reused_buffer(self._buffers, "q8f", torch.float32, PIECE)
        for b0 in range(0, nblocks, step):
            b1 = min(nblocks, b0 + step)
            x = blocks[b0:b1]
            s = a[: x.numel()].view(b1 - b0, Q8_0_BLOCK)
            fl = f[: x.numel()].view(b1 - b0, Q8_0_BLOCK)
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
    while the writer thread writes the next block. ``verify.verify_gguf`` with
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
        blocks, encoder = RowBlockReader(reader, chunk_bytes), BlockEncoder()
        with torch_threads(1):
            for file, out, tensors in zip(files, writer.fout, writer.tensors, strict=True):
                digests[file.name] = _write_data(
                    file, out, [by_name[n] for n in tensors], blocks, encoder, writer, progress,
                    check,
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
    encoder: BlockEncoder,
    writer: GGUFWriter,
    progress: Progress,
    check: VerifyReport | None = None,
) -> str:
    """Stream ``tensors`` into ``out`` (header already written), fsync; returns the sha256.
    With ``check``, each block is read back and checked as it is written
    (``verify.WrittenCheck``)."""
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
        checker = WrittenCheck(file, out.tell(), sink, check, progress, source)
        blocks.drop_pages = False  # the check's second read of the block drops them
    pos = 0  # bytes handed to the writer after the header
    try:
        for t in tensors:
            progress.check_abort()
            written = 0
            for rows in blocks.blocks(t):
                slot = sink.take_slot()
                data = encoder.encode(rows, t.ggml_type, t.type_name, slot)
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
