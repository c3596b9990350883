"""The offload store: a job's weights on disk, one directory, one index.

On-disk format (version 1) of ``<settings.jobs_dir>/<job id>/offload/``::

    index.json      {"format": "modelprep.offload", "version": 1,
                     "roots": ["/abs/checkpoint/dir", ...],
                     "tensors": {"<name>": {
                         "kind": "ref" | "owned",
                         "path": "/abs/source/file" (ref) | "data/000007.bin" (owned),
                         "offset": int, "length": int,
                         "dtype": "float32" | "bfloat16" | ..., "shape": [int, ...],
                         "encoding": "raw" | "q8_0" | "q4_0",
                         "parts": [["/abs/source/file", offset, length], ...]}}}   (optional)
    metrics.json    {"reloads": int, "bytes_read": int}   (last persisted counters)
    data/NNNNNN.bin the bytes of one owned tensor, little-endian, C order

* ``ref`` entries point *in place* into a source file (a safetensors shard): nothing is copied,
  they cost no disk. Their path must lie under one of ``roots`` (checked on every read). A
  tensor made of several stored ones (a MoE layer's expert stack packed from per-expert
  tensors, ``checkpoint.experts``) lists its byte runs in order in ``parts``; ``path`` and
  ``offset`` are then the first run's, ``length`` the sum.
* ``owned`` entries were written by the store (tensors from pickles, casts, quantized packs).
  Their path is relative to the store and must stay inside it.
* ``raw`` bytes are ``dtype`` elements of ``shape``; ``q8_0``/``q4_0`` bytes are GGML blocks
  (the exact bytes a GGUF file holds) of a ``shape``-d float tensor, ``dtype`` being float32.

Crash safety: a data file is fsync'ed before its entry can be indexed, and ``index.json`` is only
ever replaced whole (temp file in the same directory, fsync, ``os.replace``, fsync of the
directory). A crash leaves the previous index; data files it does not name are leftovers of an
interrupted write and are deleted when the store is reopened.

One process (the job's) writes a store; others only read its files (``offload_usage``).

Quota and disk full: only owned bytes count towards ``quota_bytes``. Exceeding it raises
:class:`OffloadQuotaExceeded`; ``ENOSPC`` raises :class:`DiskFull`. Either way the store deletes
its own files at once (a full disk must not stay full because of a failed job) and becomes
unusable; other stores are untouched.

Why one module of over 450 lines: :class:`OffloadStore` is the only code that reads or writes
the format above, so its writes, reads, index persistence, quota and cleanup on failure sit in
one class that keeps the crash-safety rules in one place.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from service.checkpoint.base import FileRegion
from service.config import Settings
from service.errors import DiskFull, OffloadQuotaExceeded, PathOutsideRoot, ServiceError
from service.fsutil import atomic_write_json, fsync_dir
from service.offload.paths import DATA_DIR, INDEX_NAME, METRICS_NAME, inside, job_store_dir
from service.tensors import dtype_name, tensor_bytes

FORMAT = "modelprep.offload"
VERSION = 1

Encoding = Literal["raw", "q8_0", "q4_0"]


class OffloadStoreError(ServiceError):
    """The store is unusable: corrupt index, unknown tensor, or already aborted."""

    code = "offload_store_error"
    title = "Offload store error"


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise OffloadStoreError(f"unknown dtype {name!r} in offload index")
    return value


@dataclass(frozen=True)
class StoreEntry:
    kind: Literal["ref", "owned"]
    path: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding = "raw"
    parts: tuple[tuple[str, int, int], ...] = ()
    """A ``ref`` made of several runs: ``(path, offset, length)`` each, in order."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def runs(self) -> tuple[tuple[str, int, int], ...]:
        """The entry's bytes as ``(path, offset, length)`` runs, in order."""
        return self.parts or ((self.path, self.offset, self.length),)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        if self.parts:
            data["parts"] = [list(p) for p in self.parts]
        else:
            del data["parts"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoreEntry:
        return cls(
            kind=data["kind"],
            path=data["path"],
            offset=int(data["offset"]),
            length=int(data["length"]),
            dtype=data["dtype"],
            shape=tuple(int(d) for d in data["shape"]),
            encoding=data.get("encoding", "raw"),
            parts=tuple((str(p), int(o), int(n)) for p, o, n in data.get("parts", ())),
        )


class OffloadStore:
    """One job's offloaded weights; not shared between processes while written."""

    def __init__(
        self,
        root: Path,
        *,
        quota_bytes: int | None = None,
        allowed_roots: Iterable[Path] = (),
        keep_on_failure: bool = False,
    ) -> None:
        """Open (or create) the store at ``root``; see :func:`open_store` for the usual way."""
        self.root = root
        self.quota_bytes = quota_bytes
        self.keep_on_failure = keep_on_failure
        self._lock = threading.Lock()
        self._entries: dict[str, StoreEntry] = {}
        self._roots: list[Path] = [p.resolve() for p in allowed_roots]
        self._owned_bytes = 0
        self._next_file = 0
        self._dirty = False
        self._aborted: str | None = None
        self.reloads = 0
        self.bytes_read = 0
        (root / DATA_DIR).mkdir(parents=True, exist_ok=True)
        self._load_existing()

    # -- opening ----------------------------------------------------------------------------

    def _load_existing(self) -> None:
        index_path = self.root / INDEX_NAME
        if index_path.exists():
            try:
                index = json.loads(index_path.read_text(encoding="utf-8"))
                if index.get("format") != FORMAT or index.get("version") != VERSION:
                    raise OffloadStoreError(f"{index_path} is not a version {VERSION} store")
                for root in index.get("roots", []):
                    if Path(root).resolve() not in self._roots:
                        self._roots.append(Path(root).resolve())
                for name, raw in index["tensors"].items():
                    self._entries[name] = StoreEntry.from_json(raw)
            except (ValueError, KeyError, TypeError) as exc:
                raise OffloadStoreError(f"corrupt offload index {index_path}: {exc}") from exc
        metrics_path = self.root / METRICS_NAME
        if metrics_path.exists():
            try:
                metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
                self.reloads = int(metrics.get("reloads", 0))
                self.bytes_read = int(metrics.get("bytes_read", 0))
            except ValueError:
                pass  # counters are informative only; a torn metrics file restarts them at 0
        indexed = {e.path for e in self._entries.values() if e.kind == "owned"}
        for data_file in sorted((self.root / DATA_DIR).iterdir()):
            rel = f"{DATA_DIR}/{data_file.name}"
            if rel not in indexed:
                data_file.unlink()  # leftover of a write interrupted before the index named it
            else:
                self._next_file = max(self._next_file, int(data_file.stem) + 1)
        self._owned_bytes = sum(e.length for e in self._entries.values() if e.kind == "owned")

    # -- writing ----------------------------------------------------------------------------

    def add_root(self, root: Path) -> None:
        """Allow references into files under ``root`` (a checkpoint directory)."""
        resolved = root.resolve()
        if resolved not in self._roots:
            self._roots.append(resolved)
            self._dirty = True

    def put_reference(
        self, name: str, region: FileRegion, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> StoreEntry:
        """Index ``name`` as bytes already on disk (zero copy); the file must be under a root."""
        self._check_usable()
        path = region.path.resolve()
        if not any(path.is_relative_to(r) for r in self._roots):
            raise PathOutsideRoot(f"{region.path} is outside the checkpoint roots of the store")
        expected = _numel(shape) * dtype.itemsize
        if region.length != expected:
            raise OffloadStoreError(
                f"{name}: region holds {region.length} bytes, {dtype} {list(shape)} needs {expected}"
            )
        entry = StoreEntry("ref", str(path), region.offset, region.length, dtype_name(dtype), shape)
        return self._index(name, entry)

    def put_reference_parts(
        self, name: str, regions: list[FileRegion], dtype: torch.dtype, shape: tuple[int, ...]
    ) -> StoreEntry:
        """Index ``name`` as the concatenation of ``regions`` already on disk (zero copy)."""
        self._check_usable()
        if not regions:
            raise OffloadStoreError(f"{name}: no regions to reference")
        if len(regions) == 1:
            return self.put_reference(name, regions[0], dtype, shape)
        runs = []
        for region in regions:
            path = region.path.resolve()
            if not any(path.is_relative_to(r) for r in self._roots):
                raise PathOutsideRoot(f"{region.path} is outside the checkpoint roots of the store")
            runs.append((str(path), region.offset, region.length))
        expected = _numel(shape) * dtype.itemsize
        total = sum(n for _, _, n in runs)
        if total != expected:
            raise OffloadStoreError(
                f"{name}: regions hold {total} bytes, {dtype} {list(shape)} needs {expected}"
            )
        entry = StoreEntry(
            "ref", runs[0][0], runs[0][1], total, dtype_name(dtype), shape, parts=tuple(runs)
        )
        return self._index(name, entry)

    def put_tensor(self, name: str, tensor: torch.Tensor) -> StoreEntry:
        """Write ``tensor``'s bytes into the store (one file) and index it."""
        flat = tensor.detach().contiguous().reshape(-1)
        return self.put_chunks(name, [flat], tensor.dtype, tuple(tensor.shape))

    def put_chunks(
        self,
        name: str,
        chunks: Iterable[torch.Tensor],
        dtype: torch.dtype,
        shape: tuple[int, ...],
        encoding: Encoding = "raw",
    ) -> StoreEntry:
        """Stream a tensor's bytes, piece by piece, into one owned file (bounded memory)."""
        self._check_usable()
        with self._lock:
            rel = f"{DATA_DIR}/{self._next_file:06d}.bin"
            self._next_file += 1
        path = self.root / rel
        written = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for chunk in chunks:
                    data = tensor_bytes(chunk)
                    if self.quota_bytes is not None and (
                        self._owned_bytes + written + len(data) > self.quota_bytes
                    ):
                        raise OffloadQuotaExceeded(
                            f"offload quota of {self.quota_bytes} bytes exceeded while writing "
                            f"{name} ({self._owned_bytes + written + len(data)} bytes needed)"
                        )
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                        written += n
                os.fsync(fd)
            finally:
                os.close(fd)
        except OffloadQuotaExceeded as exc:
            self._abort(str(exc))
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                message = f"disk full while offloading {name} to {self.root}"
                self._abort(message)
                raise DiskFull(message) from exc
            path.unlink(missing_ok=True)
            raise
        entry = StoreEntry("owned", rel, 0, written, dtype_name(dtype), shape, encoding)
        self._owned_bytes += written
        return self._index(name, entry)

    def put_quantized(self, name: str, tensor: torch.Tensor, encoding: Encoding) -> StoreEntry:
        """Quantize ``tensor`` to GGML ``encoding`` blocks and keep only the packed bytes."""
        from service.offload.quant import quantize

        packed = quantize(tensor, encoding)
        return self.put_chunks(name, [packed], torch.float32, tuple(tensor.shape), encoding)

    def alias(self, name: str, target: str) -> StoreEntry:
        """Index ``name`` as the same bytes as ``target`` (tied weights stored once)."""
        return self._index(name, self.entry(target))

    def _index(self, name: str, entry: StoreEntry) -> StoreEntry:
        with self._lock:
            self._entries[name] = entry
            self._dirty = True
        return entry

    def commit(self) -> None:
        """Make every entry written so far durable (atomic index replacement)."""
        self._check_usable()
        if not self._dirty and (self.root / INDEX_NAME).exists():
            return
        with self._lock:
            index = {
                "format": FORMAT,
                "version": VERSION,
                "roots": [str(r) for r in self._roots],
                "tensors": {n: e.to_json() for n, e in self._entries.items()},
            }
            self._dirty = False
        try:
            fsync_dir(self.root / DATA_DIR)  # data files' names are durable before the index
            atomic_write_json(self.root / INDEX_NAME, index, compact=True)
        except DiskFull as exc:
            self._abort(str(exc))
            raise

    def save_metrics(self) -> None:
        """Persist the reload counters so ``offload_usage`` (another process) can report them."""
        if self._aborted is not None:
            return
        atomic_write_json(
            self.root / METRICS_NAME,
            {"reloads": self.reloads, "bytes_read": self.bytes_read},
            compact=True,
        )

    # -- reading ----------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> StoreEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise OffloadStoreError(f"{name!r} is not in the offload store {self.root}") from None

    def read_bytes(self, name: str) -> torch.Tensor:
        """The stored bytes of ``name`` as a fresh uint8 tensor; counts one reload."""
        entry = self.entry(name)
        return self._read_range(name, entry, 0, entry.length, count_reload=True)

    def _read_range(
        self, name: str, entry: StoreEntry, start: int, length: int, count_reload: bool
    ) -> torch.Tensor:
        self._check_usable()
        out = torch.empty(length, dtype=torch.uint8)
        view = out.numpy().data
        got = 0
        for path, offset, n in self._spans(entry, start, length):
            with path.open("rb", buffering=0) as f:
                f.seek(offset)
                end = got + n
                while got < end:
                    read = f.readinto(view[got:end])
                    if not read:
                        raise OffloadStoreError(f"{path} is shorter than the index says ({name})")
                    got += read
        with self._lock:
            self.reloads += int(count_reload)
            self.bytes_read += length
        return out

    def _spans(
        self, entry: StoreEntry, start: int, length: int
    ) -> Iterator[tuple[Path, int, int]]:
        """``(file, offset, bytes)`` of the entry's bytes ``[start, start + length)``, in order
        (one span, but for a reference in several parts)."""
        if not entry.parts:
            yield self._resolve(entry), entry.offset + start, length
            return
        at = 0
        for path, offset, n in entry.runs():
            if length <= 0:
                return
            if start < at + n:
                skip = start - at
                take = min(length, n - skip)
                yield self._resolve(replace(entry, path=path, parts=())), offset + skip, take
                start += take
                length -= take
            at += n

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``name`` as a fresh CPU tensor (decoded, cast to ``dtype``); the caller owns it."""
        entry = self.entry(name)
        return self._decode(entry, self.read_bytes(name), entry.shape, dtype)

    def row_nbytes(self, name: str) -> int:
        """Stored bytes of one row (first-dimension slice) of ``name``."""
        entry = self.entry(name)
        return entry.length // entry.shape[0] if entry.shape and entry.shape[0] else entry.length

    def load_rows(
        self,
        name: str,
        start: int,
        stop: int,
        dtype: torch.dtype | None = None,
        *,
        count_reload: bool = False,
    ) -> torch.Tensor:
        """Rows ``start:stop`` of ``name`` only (raw or GGML-packed rows are contiguous), so a
        huge weight can be paged in slices. ``count_reload`` marks the start of a full pass."""
        entry = self.entry(name)
        if not entry.shape or not 0 <= start <= stop <= entry.shape[0]:
            raise OffloadStoreError(f"rows {start}:{stop} out of range for {name}")
        row = self.row_nbytes(name)
        raw = self._read_range(name, entry, start * row, (stop - start) * row, count_reload)
        return self._decode(entry, raw, (stop - start, *entry.shape[1:]), dtype)

    @staticmethod
    def _decode(
        entry: StoreEntry, raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> torch.Tensor:
        if entry.encoding == "raw":
            tensor = raw.view(entry.torch_dtype).reshape(shape)
        else:
            from service.offload.quant import dequantize

            tensor = dequantize(raw, entry.encoding, shape)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        return tensor

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        """A raw entry's elements, flattened, in pieces of at most ``max_bytes`` (bounded RAM)."""
        entry = self.entry(name)
        if entry.encoding != "raw":
            raise OffloadStoreError(f"{name} is {entry.encoding}-packed; use load()")
        dtype = entry.torch_dtype
        step = max(dtype.itemsize, max_bytes - max_bytes % dtype.itemsize)
        if entry.parts:
            for start in range(0, entry.length, step):
                n = min(step, entry.length - start)
                yield self._read_range(name, entry, start, n, count_reload=False).view(dtype)
            with self._lock:
                self.reloads += 1
            return
        path = self._resolve(entry)
        with path.open("rb", buffering=0) as f:
            f.seek(entry.offset)
            left = entry.length
            while left:
                out = torch.empty(min(step, left), dtype=torch.uint8)
                n = f.readinto(out.numpy().data)
                if not n or n != out.numel():
                    raise OffloadStoreError(f"{path} is shorter than the index says ({name})")
                left -= n
                with self._lock:
                    self.bytes_read += n
                yield out.view(dtype)
        with self._lock:
            self.reloads += 1

    def _resolve(self, entry: StoreEntry) -> Path:
        if entry.kind == "owned":
            path = self.root / entry.path
            if not inside(path, self.root):
                raise PathOutsideRoot(f"offload entry {entry.path} escapes the store")
            return path
        path = Path(entry.path)
        if not any(path.resolve().is_relative_to(r) for r in self._roots):
            raise PathOutsideRoot(f"offload reference {entry.path} is outside the store's roots")
        return path

    # -- metrics and lifetime ---------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Per-store figures for the job JSON (``ctx.set_detail("offload", ...)``)."""
        from service.offload.usage import directory_usage

        owned = [e for e in self._entries.values() if e.kind == "owned"]
        refs = [e for e in self._entries.values() if e.kind == "ref"]
        usage = directory_usage(self.root) if self.root.exists() else {"bytes": 0, "files": 0}
        free = shutil.disk_usage(self.root).free if self.root.exists() else None
        return {
            "path": str(self.root),
            "bytes_on_disk": usage["bytes"],
            "files": usage["files"],
            "tensors_offloaded": len(self._entries),
            "tensors_written": len({e.path for e in owned}),
            "tensors_referenced": len(refs),
            "bytes_written": sum(e.length for e in {e.path: e for e in owned}.values()),
            "bytes_referenced": sum(
                e.length for e in {(e.path, e.offset): e for e in refs}.values()
            ),
            "reloads": self.reloads,
            "bytes_read": self.bytes_read,
            "quota_bytes": self.quota_bytes,
            "free_disk_bytes": free,
        }

    def _check_usable(self) -> None:
        if self._aborted is not None:
            raise OffloadStoreError(f"offload store {self.root} was aborted: {self._aborted}")

    def _abort(self, reason: str) -> None:
        """Give the disk back right away; the store refuses every later call."""
        self._aborted = reason
        shutil.rmtree(self.root, ignore_errors=True)

    def destroy(self) -> None:
        """Delete the store's directory (job ended)."""
        self._aborted = self._aborted or "destroyed"
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self, failed: bool = False) -> None:
        """End of the job: keep a failed store only when asked to (``keep_failed_offload``)."""
        if failed and self.keep_on_failure and self._aborted is None:
            self.save_metrics()
            return
        self.destroy()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def open_job_store(settings: Settings, job_id: str, checkpoint_root: Path | None) -> OffloadStore:
    """The offload store of job ``job_id``, with the settings' quota and retention policy."""
    store = OffloadStore(
        job_store_dir(settings.jobs_dir, job_id),
        quota_bytes=settings.offload_quota_bytes,
        keep_on_failure=settings.keep_failed_offload,
    )
    if checkpoint_root is not None:
        store.add_root(checkpoint_root if checkpoint_root.is_dir() else checkpoint_root.parent)
    return store


def discard_job_store(settings: Settings, job_id: str, failed: bool) -> bool:
    """Remove a job's offload directory when the job ended, even if its process died without
    closing the store (crash, kill); kept only for a failed job with ``keep_failed_offload``.
    Returns True when the directory was removed."""
    path = job_store_dir(settings.jobs_dir, job_id)
    if failed and settings.keep_failed_offload:
        return False
    if path.is_symlink():
        path.unlink()  # never follow a link out of the jobs directory
        return True
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()
