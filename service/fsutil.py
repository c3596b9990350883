"""File helpers every stage shares: crash-safe JSON writes and streamed hashing."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from service.errors import ConfigurationError

_HASH_BLOCK = 8 * 1024 * 1024


def atomic_write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON so that ``path`` holds either the old or the new content, never a
    torn file: temp file in the same directory, fsync, ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` before it is published with a rename."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
