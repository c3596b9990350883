"""How a job's ``source`` URI becomes a local directory or file of checkpoint files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import SecretStr

from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings
from service.stage import JobContext


@dataclass(frozen=True)
class SourceRequest:
    """The source part of a job spec; ``token`` is a secret that is never persisted."""

    uri: str
    revision: str | None = None
    sha256: str | None = None
    token: SecretStr | None = field(default=None, repr=False)
    tenant: str | None = None
    """Whose job this is: an ``s3://`` source uses the tenant's object-store credentials."""
    pinned: str | None = None
    """The commit a hub ``revision`` was resolved to by :meth:`SourceFetcher.identify` (for
    ``s3://``, the hash of the objects' ETags): the fetch then downloads exactly what the job's
    identity names, even if the branch moves meanwhile (or fails if the objects change)."""


@dataclass(frozen=True)
class SourceIdentity:
    """What a source's bytes are, independent of where they were asked for: two jobs whose
    sources have the same ``key`` read the same checkpoint (result reuse keys on it)."""

    key: str
    """``hf:<endpoint>/<repo>@<commit>``, ``sha256:<hex>`` (one HTTP file),
    ``files:<hex>`` (a local checkpoint's content hash) or ``s3:<endpoint>/<bucket>/<prefix>@
    <hex>`` (the hash of the objects' names and ETags or version ids)."""
    request: SourceRequest
    """The request that fetches exactly these bytes (a hub branch pinned to its commit)."""


@dataclass(frozen=True)
class ResolvedSource:
    path: Path
    """A local checkpoint directory or single weights file; read-only for the job."""
    uri: str
    revision: str | None = None
    """The resolved commit sha for hub sources, the objects' hash for s3 sources."""
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

    def identify(
        self,
        request: SourceRequest,
        settings: Settings,
        ctx: JobContext,
        fetched: ResolvedSource | None = None,
    ) -> SourceIdentity | None:
        """The source's identity: before the fetch (``fetched`` None) when it can be known
        without downloading the checkpoint (None otherwise), after it always."""
        ...

    def headers(self, request: SourceRequest, settings: Settings) -> CheckpointHeaders:
        """The checkpoint described from its headers alone, before (and without) a download:
        file sizes, safetensors tensor headers, config.json. Reads a few kilobytes per weight
        file whatever its size, never the weights (a plan is made from this)."""
        ...
