"""The safetensors export itself (see :mod:`service.exporters.safetensors` for what it writes).

Imports torch at import time: only the job process loads it, through the exporter's ``export``.

Why one module of over 450 lines: the shard plan (names, header bounds, :class:`ShardPlan`) and
the streamed write (prefetching, casting, hashing while writing) are kept together because the
header written first must match the bytes streamed after it byte for byte; both halves read the
same :class:`ShardTensor` offsets.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from service.checkpoint.base import ReadsInto, TensorInfo, WeightReader
from service.checkpoint.experts import ExpertLayout, in_layout, stored_layout
from service.checkpoint.safetensors import DTYPE_NAMES
from service.checkpoint.ties import tied_targets_from_config, tied_targets_of_model
from service.errors import DiskFull, ExportFailed, UnsupportedDtype
from service.exporters.base import ExportInputs, ExportResult
from service.fsutil import atomic_write_json, fsync_dir
from service.memory.libc import sync_file_range_write
from service.stage import JobContext, Phase
from service.tensors import tensor_bytes
from service.units import parse_size

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

CHUNK_BYTES = 32 * 1024 * 1024
"""Size of one read buffer; ``PREFETCH_DEPTH + 2`` of them (and as many cast buffers) exist."""

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_HEAD_LIKE = ("lm_head", "decoder", "output")


# --- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardTensor:
    """One tensor's place in an output shard: what it is read from and the bytes it takes."""

    name: str
    source: str
    """Name to read from the checkpoint (differs from ``name`` for a kept alias)."""
    source_dtype: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset relative to the shard's data section."""
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class PlannedShard:
    filename: str
    tensors: list[ShardTensor] = field(default_factory=list)
    data_size: int = 0
    header: bytes = b""
    """The full file prefix: 8-byte length + JSON padded with spaces to a multiple of 8."""

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_size


@dataclass(frozen=True)
class ShardPlan:
    shards: list[PlannedShard]
    dropped: dict[str, str]
    """Names left out because the loader re-ties them: name -> the name stored instead."""
    total_size: int
    """Sum of tensor data bytes (the index's ``metadata.total_size``)."""
    total_parameters: int

    @property
    def total_bytes(self) -> int:
        return sum(s.file_size for s in self.shards)

    @property
    def weight_map(self) -> dict[str, str]:
        return {t.name: s.filename for s in self.shards for t in s.tensors}


def out_dtype(source: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The stored dtype: floating tensors take ``dtype``, others (ints, bool) keep theirs."""
    if dtype is not None and source.is_floating_point:
        return dtype
    return source


def _entry_bound(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Upper bound of the JSON bytes one header entry takes (offsets counted at 20 digits)."""
    entry = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [10**19, 10**19]}
    return len(json.dumps({name: entry})) + 2


_HEADER_BASE = len(json.dumps({"__metadata__": {"format": "pt"}})) + 8 + 8


def choose_names(
    infos: list[TensorInfo], aliases: Mapping[str, str], tied_targets: set[str] | None
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """``[(name to write, name to read)]`` in storage order, and the dropped tied names.

    Each group of aliased names is stored once when the loader re-ties it; names the model does
    not tie are written (as a copy) so loading never leaves them uninitialised. Without model
    knowledge, one name per group is kept, preferring a non-head name.
    """
    groups: dict[str, list[str]] = {i.name: [i.name] for i in infos}
    for alias, canonical in aliases.items():
        groups[canonical].append(alias)
    written: list[tuple[str, str]] = []
    dropped: dict[str, str] = {}
    for info in infos:
        names = sorted(groups[info.name])
        if len(names) == 1:
            written.append((info.name, info.name))
            continue
        if tied_targets is not None:
            keep = [n for n in names if n not in tied_targets] or names[:1]
        else:
            keep = sorted(names, key=lambda n: (any(h in n for h in _HEAD_LIKE), n))[:1]
        written.extend((n, info.name) for n in keep)
        dropped.update({n: keep[0] for n in names if n not in keep})
    return written, dropped


def plan_shards(
    reader: WeightReader,
    dtype: torch.dtype | None,
    max_shard_size: int,
    tied_targets: set[str] | None,
) -> ShardPlan:
    """Compute every shard's tensors and header from metadata alone (no data is read)."""
    infos = reader.tensor_infos()
    by_name = {i.name: i for i in infos}
    written, dropped = choose_names(infos, reader.aliases(), tied_targets)
    groups: list[list[tuple[str, TensorInfo, torch.dtype, int, int]]] = []
    current: list[tuple[str, TensorInfo, torch.dtype, int, int]] = []
    current_size = _HEADER_BASE
    total = params = 0
    for name, source in written:
        info = by_name[source]
        dt = out_dtype(info.dtype, dtype)
        if dt not in DTYPE_NAMES:
            raise UnsupportedDtype(f"tensor {name!r} has dtype {dt} that safetensors cannot store")
        nbytes = info.numel * dt.itemsize
        cost = nbytes + _entry_bound(name, dt, info.shape)
        total += nbytes
        params += info.numel
        item = (name, info, dt, nbytes, cost)
        if cost + _HEADER_BASE > max_shard_size:
            groups.append([item])  # larger than a shard on its own: alone in its file
            continue
        if current and current_size + cost > max_shard_size:
            groups.append(current)
            current, current_size = [], _HEADER_BASE
        current.append(item)
        current_size += cost
    if current or not groups:
        groups.append(current)

    count = len(groups)
    shards = []
    for i, group in enumerate(groups, start=1):
        filename = SINGLE_FILE if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
        shard = PlannedShard(filename=filename)
        for name, info, dt, nbytes, _ in group:
            end = shard.data_size + nbytes
            shard.tensors.append(
                ShardTensor(name, info.name, info.dtype, dt, info.shape, shard.data_size, end)
            )
            shard.data_size += nbytes
        shard.header = encode_header(shard.tensors)
        shards.append(shard)
    return ShardPlan(shards=shards, dropped=dropped, total_size=total, total_parameters=params)


def encode_header(tensors: list[ShardTensor]) -> bytes:
    """The safetensors prefix for ``tensors``: length, JSON, space padding to 8-byte alignment."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        header[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [t.begin, t.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


# --- writing -----------------------------------------------------------------------------------


class _HashingFile:
    """An output file written with ``os.write`` while its sha256 is computed.

    Writeback of each written range is started at once (``sync_file_range``), so disk writes
    overlap the reading of the next chunk and the closing ``fsync`` has little left to wait for.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sha = hashlib.sha256()
        self.written = 0
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def write(self, data: memoryview | bytes) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        done = 0
        while done < len(view):
            done += os.write(self.fd, view[done:])
        if done >= 1 << 20:  # not Linux: the final fsync does all the waiting
            sync_file_range_write(self.fd, self.written, done)
        self.written += done
        return done

    def finish(self) -> str:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return self.sha.hexdigest()

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


T = TypeVar("T")


def prefetched(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """Iterate ``items`` in a background thread, at most ``depth`` ahead of the consumer.

    Reading (``pread``) and casting release the GIL, as do hashing and ``os.write``: producing
    the next chunk while the current one is hashed and written overlaps I/O with CPU work.
    Memory cost: ``depth + 2`` chunks. Stopping early (cancellation, error) stops the producer.
    """
    box: queue.Queue[tuple[int, object]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(kind: int, value: object) -> bool:
        while not stop.is_set():
            try:
                box.put((kind, value), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(0, item):
                    return
            put(1, None)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer thread
            put(2, exc)

    worker = threading.Thread(target=produce, name="export-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = box.get()
            if kind == 1:
                return
            if kind == 2:
                assert isinstance(value, BaseException)
                raise value
            yield value  # type: ignore[misc]
    finally:
        stop.set()
        worker.join()


PREFETCH_DEPTH = 2


def _shard_chunks(
    reader: WeightReader, shard: PlannedShard, chunk_bytes: int
) -> Iterator[tuple[torch.Tensor, int]]:
    """(cast piece, source bytes it came from) for every tensor of ``shard``, in order.

    With a :class:`ReadsInto` reader the pieces live in a ring of ``PREFETCH_DEPTH + 2``
    reused buffers: at most that many pieces exist at once (one being filled, ``depth``
    queued, one being written), so a slot is refilled only after the consumer is done with it.
    """
    if not isinstance(reader, ReadsInto):
        for tensor in shard.tensors:
            produced = 0
            for chunk in reader.iter_chunks(tensor.source, chunk_bytes):
                piece = chunk if chunk.dtype == tensor.dtype else chunk.to(tensor.dtype)
                produced += piece.numel() * tensor.dtype.itemsize
                yield piece, chunk.numel() * tensor.source_dtype.itemsize
            if produced != tensor.nbytes:
                raise ExportFailed(f"{tensor.source}: read {produced} of {tensor.nbytes} bytes")
        return
    slots = PREFETCH_DEPTH + 2
    raw = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(slots)]
    cast: list[torch.Tensor] = []
    turn = 0
    for tensor in shard.tensors:
        numel = tensor.nbytes // tensor.dtype.itemsize
        step = max(1, chunk_bytes // max(tensor.source_dtype.itemsize, tensor.dtype.itemsize))
        for start in range(0, numel, step):
            n = min(step, numel - start)
            slot, turn = turn % slots, turn + 1
            src = _slot(raw, slot, n, tensor.source_dtype)
            reader.read_into(tensor.source, start, src)
            if tensor.dtype == tensor.source_dtype:
                yield src, n * tensor.source_dtype.itemsize
                continue
            if not cast:
                cast = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(slots)]
            out = _slot(cast, slot, n, tensor.dtype)
            out.copy_(src)
            yield out, n * tensor.source_dtype.itemsize


def _slot(buffers: list[torch.Tensor], slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of ring buffer ``slot`` seen as ``dtype``."""
    return buffers[slot][: numel * dtype.itemsize].view(dtype)


def write_shard(
    reader: WeightReader,
    shard: PlannedShard,
    out_dir: Path,
    ctx: JobContext,
    chunk_bytes: int = CHUNK_BYTES,
) -> str:
    """Write one planned shard; returns its sha256."""
    out = _HashingFile(out_dir / shard.filename)
    try:
        out.write(shard.header)
        ctx.add_metric("bytes_written", len(shard.header))
        ctx.advance(len(shard.header))
        chunks = _shard_chunks(reader, shard, chunk_bytes)
        for piece, source_bytes in prefetched(chunks, PREFETCH_DEPTH):
            ctx.check_abort()
            # bytes_read counts source bytes: a f32 -> bf16 export reads twice what it writes
            ctx.add_metric("bytes_read", source_bytes)
            n = out.write(tensor_bytes(piece))
            ctx.add_metric("bytes_written", n)
            ctx.advance(n)
        if out.written != shard.file_size:
            raise ExportFailed(f"{shard.filename}: wrote {out.written} of {shard.file_size} bytes")
        return out.finish()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskFull(f"disk full while writing {shard.filename}") from exc
        raise
    finally:
        out.abandon()


def copy_aux(src: Path, dst: Path, dtype: str | None) -> str:
    """Copy one aux file, hashing it; ``config.json`` records the export dtype when it changed."""
    if src.name == "config.json" and dtype is not None:
        try:
            config = json.loads(src.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            config = None
        if isinstance(config, dict):
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
            return atomic_write_json(dst, config)
    sha = hashlib.sha256()
    with src.open("rb") as fin, dst.open("wb") as fout:
        while block := fin.read(1 << 20):
            sha.update(block)
            fout.write(block)
        fout.flush()
        os.fsync(fout.fileno())
    return sha.hexdigest()


# --- the export --------------------------------------------------------------------------------


def export_safetensors(
    inputs: ExportInputs,
    out_dir: Path,
    ctx: JobContext,
    *,
    dtype_name: str | None,
    max_shard_size: str | int,
    experts: ExpertLayout | None = None,
) -> ExportResult:
    """The whole export: plan every shard from metadata, then stream the data shard by shard.

    ``experts`` is the layout a MoE's experts are written in (None: the source's; see
    :func:`service.checkpoint.experts.in_layout`). Takes the spec's fields, not the spec, so
    that this module never imports :mod:`service.exporters.safetensors` (which imports it when
    exporting)."""
    max_shard = parse_size(max_shard_size)
    ckpt = inputs.checkpoint
    reader = ckpt.reader
    written_experts: ExpertLayout | None = None
    if inputs.model is not None and isinstance(inputs.model, torch.nn.Module):
        tied: set[str] | None = tied_targets_of_model(inputs.model)
        written_experts = stored_layout(reader, inputs.model)
        if experts is not None and written_experts is not None:
            reader, written_experts = in_layout(reader, inputs.model, experts), experts
    else:
        tied = tied_targets_from_config(ckpt.config) if reader.aliases() else set()
    dtype = _TORCH_DTYPES[dtype_name] if dtype_name else None
    plan = plan_shards(reader, dtype, max_shard, tied)

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx.set_phase(Phase.EXPORT, total=plan.total_bytes, unit="bytes")
    digests: dict[str, str] = {}
    with single_threaded_torch():
        for shard in plan.shards:
            digests[shard.filename] = write_shard(reader, shard, out_dir, ctx, CHUNK_BYTES)
    if len(plan.shards) > 1:
        index = {
            "metadata": {
                "total_size": plan.total_size,
                "total_parameters": plan.total_parameters,
            },
            "weight_map": dict(sorted(plan.weight_map.items())),
        }
        digests[INDEX_FILE] = atomic_write_json(out_dir / INDEX_FILE, index)
    for aux in ckpt.aux_files:
        ctx.check_abort()
        digests[aux.name] = copy_aux(aux, out_dir / aux.name, dtype_name)
    fsync_dir(out_dir)
    files = [s.filename for s in plan.shards]
    files += [INDEX_FILE] if len(plan.shards) > 1 else []
    files += [a.name for a in ckpt.aux_files]
    return ExportResult(
        files=files,
        digests=digests,
        summary={
            "dtype": dtype_name,
            "shards": len(plan.shards),
            "max_shard_size": max_shard,
            "tensors": sum(len(s.tensors) for s in plan.shards),
            "total_size": plan.total_size,
            "tied_not_stored": plan.dropped,
            "experts": written_experts,
        },
    )


@contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one intra-op thread for the duration (process-wide, then restored).

    A 32 MiB cast is memory-bound: a second OpenMP thread adds little, and on a busy host its
    barrier waits for a descheduled thread (measured: 1 thread 0.06-0.10 s CPU per GB cast,
    2 threads 0.21-0.31 s, and slower wall time too).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
