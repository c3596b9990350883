"""The Exporter protocol and its registry: a new output format is one new module.

An exporter declares a pydantic spec (its ``format`` literal is the discriminator of the job's
``exports`` list), may reject a spec at submission (``check``) and writes files into a fresh
directory (``export``). Heavy imports (torch, gguf, torch_to_nnef) stay inside ``export`` so that
the API process never loads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from service.checkpoint.base import Checkpoint
from service.jobs.context import JobContext


class ExportSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: str


@dataclass
class ExportInputs:
    """What the job has prepared once and every export of the job shares."""

    checkpoint: Checkpoint
    model: Any | None = None
    """The meta-built, disk-dispatched model when the offload engine built one (else None)."""
    skeleton: Any | None = None
    """The job's one meta build, never dispatched: an exporter that rewrites modules copies it."""
    store: Any | None = None
    """The job's offload store (:class:`service.offload.store.OffloadStore`), when opened."""


@dataclass
class ExportResult:
    files: list[str]
    """Paths written, relative to the export's output directory."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Goes into manifest.json under this export: recipe, counts, verification errors."""
    digests: dict[str, str] = field(default_factory=dict)
    """sha256 of files hashed while being written, so finalize need not read them again."""


class Exporter(Protocol):
    format: ClassVar[str]
    spec_type: ClassVar[type[ExportSpec]]
    needs_model: ClassVar[bool]
    """True when the exporter needs a module (not only a state dict)."""

    def check(self, spec: ExportSpec, config: dict[str, Any] | None) -> None:
        """Raise :class:`service.errors.InvalidRequest` for a spec this exporter cannot honour."""
        ...

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult: ...


_REGISTRY: dict[str, Exporter] = {}


def register(exporter: Exporter) -> Exporter:
    _REGISTRY[exporter.format] = exporter
    return exporter


def registry() -> dict[str, Exporter]:
    """Every known exporter by format; importing ``service.exporters`` fills it."""
    return dict(_REGISTRY)
