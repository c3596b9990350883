"""The job pipeline: source -> checkpoint -> (model) -> exports -> manifest -> published artifacts.

Runs inside the job's own process and knows nothing of HTTP or of the store: everything it
reports goes through the :class:`JobContext`. All files are written under ``layout.staging``;
``layout.publish()`` moves them into place only when the manifest is complete.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from service.checkpoint import open_checkpoint
from service.exporters import registry
from service.exporters.base import ExportInputs, ExportSpec
from service.fsutil import atomic_write_json, fsync_tree, sha256_file
from service.jobs.context import JobContext
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact, Phase
from service.jobs.spec import JobSpec
from service.sources import check_source, fetch_source

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def export_dirs(specs: list[ExportSpec]) -> list[str]:
    """One directory per export, named by format (``gguf``, ``gguf-2`` when a format repeats)."""
    seen: Counter[str] = Counter()
    names = []
    for spec in specs:
        seen[spec.format] += 1
        n = seen[spec.format]
        names.append(spec.format if n == 1 else f"{spec.format}-{n}")
    return names


def check_spec(spec: JobSpec, ctx_settings: Any, config: dict[str, Any] | None = None) -> None:
    """Everything knowable before running: source allowed, each export possible."""
    check_source(spec.source_request(), ctx_settings)
    exporters = registry()
    for export in spec.export_specs():
        exporters[export.format].check(export, config)


def run_pipeline(spec: JobSpec, ctx: JobContext, layout: JobLayout) -> list[Artifact]:
    """Run every phase of the job; returns the published artifacts."""
    exporters = registry()
    ctx.set_phase(Phase.DOWNLOAD, unit="bytes")
    resolved = fetch_source(spec.source_request(), ctx.settings, ctx)
    source_info: dict[str, Any] = {"uri": resolved.uri, "cache_hit": resolved.cache_hit}
    if resolved.revision:
        source_info["revision"] = resolved.revision
    ctx.set_detail("source", source_info)
    ctx.check_abort()

    ctx.set_phase(Phase.READ, unit="tensors")
    with open_checkpoint(resolved.path) as checkpoint:
        infos = checkpoint.reader.tensor_infos()
        ctx.advance(len(infos))
        model_info: dict[str, Any] = {
            "format": checkpoint.format,
            "tensor_count": len(infos),
            "parameter_count": sum(i.numel for i in infos),
            "bytes": sum(i.nbytes for i in infos),
            "architecture": (checkpoint.config or {}).get("architectures", [None])[0],
        }
        ctx.set_detail("model", model_info)
        specs = spec.export_specs()
        for export in specs:
            exporters[export.format].check(export, checkpoint.config)

        inputs = ExportInputs(checkpoint=checkpoint)
        summaries: list[dict[str, Any]] = []
        digests: dict[str, str] = {}
        for export, dirname in zip(specs, export_dirs(specs), strict=True):
            ctx.check_abort()
            out_dir = layout.staging / dirname
            out_dir.mkdir(parents=True, exist_ok=True)
            result = exporters[export.format].export(export, inputs, out_dir, ctx)
            for rel, digest in result.digests.items():
                digests[f"{dirname}/{rel}"] = digest
            summaries.append(
                {"format": export.format, "dir": dirname, "spec": export.model_dump(mode="json"),
                 **result.summary}
            )

    ctx.set_phase(Phase.FINALIZE, unit="files")
    artifacts = _describe_files(layout.staging, digests, ctx)
    manifest = {
        "job_id": ctx.job_id,
        "source": source_info,
        "recipe": spec.stored(),
        "model": model_info,
        "exports": summaries,
        "files": [a.__dict__ for a in artifacts],
    }
    atomic_write_json(layout.staging / MANIFEST, manifest)
    manifest_path = layout.staging / MANIFEST
    artifacts.append(
        Artifact(MANIFEST, manifest_path.stat().st_size, sha256_file(manifest_path))
    )
    fsync_tree(layout.staging)
    layout.publish()
    return artifacts


def _describe_files(root: Path, digests: dict[str, str], ctx: JobContext) -> list[Artifact]:
    artifacts = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        digest = digests.get(rel) or sha256_file(path)
        artifacts.append(Artifact(rel, path.stat().st_size, digest))
        ctx.advance(1)
    return artifacts
