"""File helpers every stage shares: crash-safe JSON writes and streamed hashing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from service.errors import ConfigurationError, DiskFull

_HASH_BLOCK = 8 * 1024 * 1024


def atomic_write_json(path: Path, data: Any, *, compact: bool = False) -> str:
    """Write ``data`` as JSON with :func:`atomic_write_text`; returns its sha256. ``compact``
    drops the indentation: for index files rewritten often (the offload store's), where nobody
    reads them by eye."""
    if compact:
        text = json.dumps(data, separators=(",", ":"))
    else:
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return atomic_write_text(path, text)


def atomic_write_text(path: Path, text: str) -> str:
    """Write ``text`` (UTF-8) so that ``path`` holds either the old or the new content, never a
    torn file; returns the sha256 of the bytes written (an export lists it without rereading).

    Temp file in the same directory, fsync, ``os.replace``, fsync of the directory so that the
    rename itself survives a crash. A full disk is :class:`DiskFull`, with the temp file
    removed."""
    raw = text.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DiskFull(f"disk full while writing {path.name}") from exc
        raise
    fsync_dir(path.parent)
    return hashlib.sha256(raw).hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file, read in blocks so that RAM does not grow with its size."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make the names in directory ``path`` durable (a file's own fsync does not cover its
    directory entry: after a crash a renamed or new file could be missing)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` before it is published with a rename."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def ensure_writable_dir(path: Path, setting: str) -> None:
    """Create ``path`` if needed and make sure this process can write into it, or raise a
    :class:`ConfigurationError` whose one line names the path, the user and the fix.

    Why: in a container the service runs as an unprivileged user, and a host directory
    bind-mounted over its data directory keeps the host's owner (often root); Python would
    otherwise fail later with a traceback about some subdirectory."""
    who = f"uid {os.getuid()} gid {os.getgid()}"
    fix = (
        f"make it writable by {who} (on the host: chown -R {os.getuid()}:{os.getgid()} "
        f"<the directory mounted there>) or point {setting} elsewhere"
    )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise ConfigurationError(f"cannot create {path} ({setting}): {fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigurationError(f"{path} ({setting}) is not writable by {who}: {fix}")
