"""``file://`` sources: a checkpoint directory or a weights file under an allowed local root."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from service.config import Settings
from service.errors import SourceNotAllowed, SourceNotFound, SourceUnreadable
from service.sources.base import ResolvedSource, SourceRequest
from service.stage import JobContext


def resolve_under_roots(path: Path, roots: list[Path]) -> Path:
    """The real path of ``path`` if it lies under one of ``roots``; symlinks are followed first,
    so a link that points out of a root is refused."""
    if not path.is_absolute():
        raise SourceNotAllowed(f"local source path must be absolute: {path}")
    real = path.resolve()
    for root in roots:
        if real == root or real.is_relative_to(root):
            return real
    raise SourceNotAllowed(f"source {path} is not under an allowed local root")


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

    def check(self, request: SourceRequest, settings: Settings) -> None:
        self.path(request, settings)

    def fetch(self, request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
        return ResolvedSource(path=self.path(request, settings), uri=request.uri)
