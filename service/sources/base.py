"""How a job's ``source`` URI becomes a local directory or file of checkpoint files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import SecretStr

from service.config import Settings
from service.stage import JobContext


@dataclass(frozen=True)
class SourceRequest:
    """The source part of a job spec; ``token`` is a secret that is never persisted."""

    uri: str
    revision: str | None = None
    sha256: str | None = None
    token: SecretStr | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ResolvedSource:
    path: Path
    """A local checkpoint directory or single weights file; read-only for the job."""
    uri: str
    revision: str | None = None
    """The resolved commit sha for hub sources."""
    cache_hit: bool = False
    bytes_downloaded: int = 0


class SourceFetcher(Protocol):
    schemes: tuple[str, ...]

    def check(self, request: SourceRequest, settings: Settings) -> None:
        """Submission-time validation; raise a SourceError subclass for a source known to be bad."""
        ...

    def fetch(
        self, request: SourceRequest, settings: Settings, ctx: JobContext
    ) -> ResolvedSource: ...
