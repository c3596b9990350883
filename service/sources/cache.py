"""The download cache shared by every job and every worker process on the machine.

On-disk format, under ``settings.cache_dir``::

    entries/<key>/files/...   the downloaded files; read-only for jobs
    entries/<key>/entry.json  written last (temp file + fsync + os.replace): its presence marks
                              the entry complete; its mtime is the entry's last use (LRU order)
    locks/<key>.fill          exclusive flock: held by the one process filling the entry, so two
                              jobs of the same source download it once, concurrently too
    locks/<key>.use           shared flock held by every process using the entry until the job
                              ends (process exit or :func:`release_all`); eviction takes it
                              exclusively without waiting, so an entry in use is never evicted
    locks/evict               exclusive flock serializing eviction passes
    trash/                    entries are renamed here before removal, so a half-deleted entry
                              is never mistaken for a complete one

Lock files are never deleted: two processes must always lock the same inode. ``flock`` locks
belong to the open file, so the kernel drops them when a job process dies, however it dies.
The cache must therefore live on a local filesystem (some NFS setups do not honour ``flock``).
Keys are chosen by the fetchers (``hub--<org>--<repo>--<commit>--<endpoint>``,
``sha256--<hex>``) and must be plain file names.

The size limit is enforced before a download (making room for its expected size) and after it.
Entries in use are never evicted, so the cache can exceed its limit while more bytes than the
limit are in use; the next pass after those jobs end brings it back under.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import Settings
from service.errors import InvalidRequest
from service.fsutil import atomic_write_json

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_MANIFEST = "entry.json"

# Shared "use" locks this process holds: key -> open file descriptors (one per acquire).
_LEASES: dict[str, list[int]] = {}


@dataclass(frozen=True)
class CacheEntry:
    key: str
    path: Path
    """The entry's ``files`` directory."""
    hit: bool
    """True when the files were already complete: this process downloaded nothing."""
    bytes_downloaded: int


Fill = Callable[[Path], int]
"""Downloads an entry's files into the given directory and returns the bytes it downloaded.
It may find files of an interrupted earlier fill there and reuse them."""


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


class DownloadCache:
    """Plain functions over the format above; cheap to construct, holds no state of its own."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    @classmethod
    def from_settings(cls, settings: Settings) -> DownloadCache:
        return cls(settings.cache_dir, settings.cache_max_bytes)

    def _dirs(self) -> tuple[Path, Path, Path]:
        entries, locks, trash = self.root / "entries", self.root / "locks", self.root / "trash"
        for d in (entries, locks, trash):
            d.mkdir(parents=True, exist_ok=True)
        return entries, locks, trash

    def entry_dir(self, key: str) -> Path:
        if not _KEY.match(key) or ".." in key:
            raise InvalidRequest(f"invalid cache key {key!r}")
        return self.root / "entries" / key

    def acquire(
        self, key: str, fill: Fill, *, expected_bytes: int | None = None,
        source: dict[str, Any] | None = None,
    ) -> CacheEntry:
        """Hold entry ``key`` for this process and return it complete, filling it if needed.

        The entry stays held (never evicted) until :func:`release` / :func:`release_all` or the
        process exits. Concurrent callers for one key wait for the one filling it, then hit.
        """
        entry = self.entry_dir(key)
        _entries, locks, _trash = self._dirs()
        use_fd = os.open(locks / f"{key}.use", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(use_fd, fcntl.LOCK_SH)
            with _flock(locks / f"{key}.fill", fcntl.LOCK_EX):
                manifest = entry / _MANIFEST
                if manifest.exists():
                    os.utime(manifest)
                    result = CacheEntry(key, entry / "files", hit=True, bytes_downloaded=0)
                else:
                    self.evict(reserve=expected_bytes or 0)
                    (entry / "files").mkdir(parents=True, exist_ok=True)
                    downloaded = fill(entry / "files")
                    atomic_write_json(manifest, {
                        "key": key,
                        "bytes": _tree_bytes(entry / "files"),
                        "created": time.time(),
                        "source": source or {},
                    })
                    result = CacheEntry(key, entry / "files", hit=False,
                                        bytes_downloaded=downloaded)
        except BaseException:
            os.close(use_fd)
            raise
        _LEASES.setdefault(key, []).append(use_fd)
        if not result.hit:
            self.evict()
        return result

    def usage(self) -> int:
        """Bytes of downloaded files in entries, complete or not (what the limit applies to)."""
        entries = self.root / "entries"
        if not entries.exists():
            return 0
        return sum(_tree_bytes(child / "files") for child in entries.iterdir())

    def evict(self, reserve: int = 0) -> list[str]:
        """Remove least-recently-used entries not in use until ``reserve`` more bytes fit under
        the limit; returns the keys removed."""
        entries, locks, trash = self._dirs()
        removed: list[str] = []
        with _flock(locks / "evict", fcntl.LOCK_EX):
            candidates: list[tuple[float, str, int]] = []
            for child in entries.iterdir():
                manifest = child / _MANIFEST
                try:
                    last_used = (manifest if manifest.exists() else child).stat().st_mtime
                except FileNotFoundError:
                    continue
                candidates.append((last_used, child.name, _tree_bytes(child / "files")))
            total = sum(size for _, _, size in candidates)
            for _last_used, key, size in sorted(candidates):
                if total + reserve <= self.max_bytes:
                    break
                fd = os.open(locks / f"{key}.use", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError as exc:
                        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                            continue  # in use by a running job
                        raise
                    doomed = trash / f"{key}.{uuid.uuid4().hex}"
                    os.replace(entries / key, doomed)
                finally:
                    os.close(fd)
                shutil.rmtree(doomed, ignore_errors=True)
                total -= size
                removed.append(key)
                log.info("cache entry evicted", extra={"key": key, "bytes": size})
        return removed


def release(key: str) -> None:
    """Stop holding entry ``key`` in this process; eviction may then remove it."""
    for fd in _LEASES.pop(key, []):
        os.close(fd)


def release_all() -> None:
    """Release every entry this process holds; call when the job ends (process exit does too)."""
    for key in list(_LEASES):
        release(key)
