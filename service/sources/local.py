"""``file://`` sources: a checkpoint directory or a weights file under an allowed local root."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from service.checkpoint import aux_files_in, weight_files
from service.checkpoint.headers import CheckpointHeaders, config_of, local_file_header
from service.config import Settings
from service.errors import SourceNotAllowed, SourceNotFound, SourceUnreadable
from service.fsutil import sha256_file
from service.sources.base import ResolvedSource, SourceIdentity, SourceRequest
from service.stage import JobContext, Phase


def resolve_under_roots(path: Path, roots: list[Path]) -> Path:
    """The real path of ``path`` if it lies under one of ``roots``; symlinks are followed first,
    so a link that points out of a root is refused."""
    if not path.is_absolute():
        raise SourceNotAllowed(f"local source path must be absolute: {path}")
    real = path.resolve()
    for root in roots:
        if real == root or real.is_relative_to(root):
            return real
    raise SourceNotAllowed(
        f"source {path} is not under an allowed local root: the service reads file:// sources "
        "only under the directories of its MODELPREP_LOCAL_ROOTS setting, a JSON list (e.g. "
        """MODELPREP_LOCAL_ROOTS='["/srv/models"]'); put the checkpoint under one, or ask the """
        "operator to add its directory"
    )


def check_readable(path: Path) -> None:
    """Refuse a checkpoint with a file or directory this process may not read, naming the first
    one and the fix, before any phase starts (rather than a PermissionError deep in a reader)."""
    pending = [path]
    while pending:
        entry = pending.pop()
        is_dir = entry.is_dir()
        if not os.access(entry, os.R_OK | os.X_OK if is_dir else os.R_OK):
            raise SourceUnreadable(
                f"{entry} is not readable by uid {os.getuid()} gid {os.getgid()}: make the "
                f"checkpoint readable by that user (e.g. chmod -R a+rX on the host directory)"
            )
        if is_dir:
            pending.extend(sorted(entry.iterdir(), reverse=True))


def checkpoint_files(path: Path) -> list[tuple[str, Path]]:
    """The files a job reads of a local source, as (name relative to the checkpoint, path):
    every regular file under a directory but hidden ones (``.git``, editors' files); for a
    single weights file, the file and the files beside it that travel with weights (config,
    tokenizer), which the checkpoint reader takes from its directory."""
    if path.is_dir():
        return sorted(
            (entry.relative_to(path).as_posix(), entry)
            for entry in path.rglob("*")
            if entry.is_file()
            and not any(part.startswith(".") for part in entry.relative_to(path).parts)
        )
    beside = aux_files_in(path.parent)
    return sorted([(path.name, path), *((p.name, p) for p in beside if p != path)])


def _cached_digest(path: Path, cache: Path) -> tuple[str, bool]:
    """(sha256 of ``path``, whether it came from the digest cache).

    The cache is keyed by what changes whenever the file's bytes do: device, inode, size,
    mtime and ctime in nanoseconds (ctime cannot be set back by a user), so a checkpoint of
    hundreds of GB is read once, not by every job of it."""
    st = path.stat()
    entry = cache / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"
    try:
        digest = entry.read_text(encoding="ascii").strip()
        if len(digest) == 64:
            return digest, True
    except OSError:
        pass
    digest = sha256_file(path)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".digest.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(digest)
    os.replace(tmp, entry)
    return digest, False


@dataclass(frozen=True)
class LocalSource:
    """A ``file://`` source resolved once: its real path, under an allowed root and readable
    (:meth:`LocalFetcher.resolve`). What a submission judges a local checkpoint by."""

    path: Path
    """The checkpoint directory or weights file."""

    @property
    def directory(self) -> Path:
        """The checkpoint's directory (a weights file's own)."""
        return self.path if self.path.is_dir() else self.path.parent

    def config(self) -> dict[str, Any] | None:
        """Its config.json; None when absent or unusable, as the job will see it."""
        try:
            config = json.loads((self.directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # deeply nested JSON recurses
            return None
        return config if isinstance(config, dict) else None

    def size_bytes(self) -> int | None:
        """The bytes of its files (a directory's top level, or the one file); None when they
        cannot be read (the job will say why)."""
        try:
            files = (
                [p for p in self.path.iterdir() if p.is_file()] if self.path.is_dir()
                else [self.path]
            )
            return sum(p.stat().st_size for p in files)
        except OSError:
            return None


class LocalFetcher:
    schemes: tuple[str, ...] = ("file",)

    def path(self, request: SourceRequest, settings: Settings) -> Path:
        """The real local path of the source, checked against the allowed roots."""
        parsed = urlparse(request.uri)
        if parsed.netloc not in ("", "localhost"):
            raise SourceNotAllowed(f"file:// source must be local, got host {parsed.netloc!r}")
        real = resolve_under_roots(Path(unquote(parsed.path)), settings.local_roots)
        if not real.exists():
            raise SourceNotFound(f"source {parsed.path} does not exist")
        check_readable(real)
        return real

    def resolve(self, request: SourceRequest, settings: Settings) -> LocalSource:
        """The source resolved and checked (:meth:`path`), for a submission to judge."""
        return LocalSource(self.path(request, settings))

    def check(self, request: SourceRequest, settings: Settings) -> None:
        self.path(request, settings)

    def fetch(self, request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
        return ResolvedSource(path=self.path(request, settings), uri=request.uri)

    def identify(
        self,
        request: SourceRequest,
        settings: Settings,
        ctx: JobContext,
        fetched: ResolvedSource | None = None,
    ) -> SourceIdentity:
        """``files:<hex>``: a hash over the name, size and sha256 of every file the job reads
        (:func:`checkpoint_files`), wherever the checkpoint lives. File digests are cached by
        inode and change times under ``cache_dir/digests``, so only new or changed files are
        read (at disk speed, as the ``download`` phase's progress)."""
        files = checkpoint_files(self.path(request, settings))
        ctx.set_phase(Phase.DOWNLOAD, sum(p.stat().st_size for _, p in files), "bytes")
        cache = settings.cache_dir / "digests"
        combined = hashlib.sha256()
        hashed = 0
        for name, file in files:
            ctx.check_abort()
            digest, hit = _cached_digest(file, cache)
            size = file.stat().st_size
            hashed += 0 if hit else size
            combined.update(f"{name}\0{size}\0{digest}\n".encode())
            ctx.advance(size)
        ctx.add_metric("bytes_hashed", hashed)
        return SourceIdentity(f"files:{combined.hexdigest()}", request)

    def headers(self, request: SourceRequest, settings: Settings) -> CheckpointHeaders:
        """Each weight file's safetensors header (a pickle has none: sizes only), config.json
        and the size of every file the job reads."""
        path = self.path(request, settings)
        root = path if path.is_dir() else path.parent
        fmt, weights = weight_files(path)
        files = {name: p.stat().st_size for name, p in checkpoint_files(path)}
        names = tuple(p.relative_to(root).as_posix() for p in weights)
        for name, p in zip(names, weights, strict=True):
            files.setdefault(name, p.stat().st_size)  # a shard an index names, wherever it is
        tensors = [t for p in weights for t in local_file_header(p)] if fmt == "safetensors" else []
        try:
            config = config_of((root / "config.json").read_bytes())
        except OSError:
            config = None
        return CheckpointHeaders(fmt, files, tuple(tensors), config, names)
