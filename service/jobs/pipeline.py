"""The job pipeline: source -> checkpoint -> (model) -> exports -> manifest -> published artifacts.

Runs inside the job's own process and knows nothing of HTTP or of the store: everything it
reports goes through the :class:`JobContext`. All files are written under ``layout.staging``;
``layout.publish()`` moves them into place only when the manifest is complete.

Why one module of over 450 lines: it is the job's life in order, one private function per phase
(download, identify, adapter, build, export, verify, describe), plus :class:`_ModelSession`, the
one offload store and reference outputs every export of the job shares. Each phase's work lives
in its stage package; what stays here is the order and what one phase hands the next, which a
reader follows top to bottom.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service.checkpoint import open_checkpoint
from service.checkpoint.base import Checkpoint
from service.errors import (
    NoModelConfig,
    ReferenceUnavailable,
    VerificationFailed,
)
from service.exporters import registry
from service.exporters.base import ExportInputs, ExportSpec, Needs
from service.fsutil import atomic_write_json, atomic_write_text, fsync_tree, sha256_file
from service.jobs.artifact_store import ArtifactStore
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact
from service.jobs.model_card import CARD
from service.jobs.model_card import render as render_card
from service.jobs.spec import JobSpec
from service.jobs.versions import tool_versions
from service.memory.heap import release_between_stages
from service.sources import (
    ResolvedSource,
    SourceIdentity,
    SourceRequest,
    fetch_source,
    identify_source,
)
from service.sources.adapter import fetch_adapter, identify_adapter
from service.stage import JobContext, Phase
from service.verification.logits import check_text

if TYPE_CHECKING:
    from service.checkpoint.lora import AdapterPlan
    from service.offload.build import BuiltModel
    from service.offload.store import OffloadStore
    from service.verification.independent import IndependentReference

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ALL_ON_DISK = 1
"""A ``max_memory`` (bytes) no module fits in: every weight stays in the offload store."""


def export_dirs(specs: list[ExportSpec]) -> list[str]:
    """One directory per export, named by format (``gguf``, ``gguf-2`` when a format repeats)."""
    seen: Counter[str] = Counter()
    names = []
    for spec in specs:
        seen[spec.format] += 1
        n = seen[spec.format]
        names.append(spec.format if n == 1 else f"{spec.format}-{n}")
    return names


class ReuseGate(Protocol):
    """Result reuse, as the pipeline sees it (:mod:`service.jobs.reuse` implements it on the
    job store)."""

    def settle(
        self, identity: SourceIdentity, spec: JobSpec, ctx: JobContext
    ) -> list[Artifact] | None:
        """The published artifacts of an identical job this one shares, or None: compute."""
        ...


def run_pipeline(
    spec: JobSpec,
    ctx: JobContext,
    layout: JobLayout,
    reuse: ReuseGate | None = None,
    tenant: str | None = None,
) -> list[Artifact]:
    """Run every phase of the job; returns the published artifacts.

    With ``reuse``, the source's identity is resolved first (before the download when it can
    be: hub commit, declared sha256, local content hash; after it otherwise), and a job whose
    result already exists or is being computed shares it instead of running the phases.
    With an artifact store (``MODELPREP_ARTIFACT_STORE``) the published files go to the
    bucket, manifest last, and leave the local disk."""
    ctx.set_phase(Phase.DOWNLOAD, unit="bytes")
    request = spec.source_request(tenant)
    adapter_request = spec.adapter_request(tenant)
    identity = None
    if reuse is not None:
        identity, adapter_request = _identify(request, adapter_request, ctx)
        if identity is not None:
            request = identity.request  # a hub branch pinned to the commit it resolved to
            shared = reuse.settle(identity, spec, ctx)
            if shared is not None:
                return shared
    checkpoint_dir, source_info, resolved = _download(request, ctx)
    adapter = _download_adapter(adapter_request, ctx) if adapter_request else None
    if reuse is not None and identity is None:
        identity, _ = _identify(
            request, adapter_request, ctx, fetched=resolved,
            adapter_fetched=adapter[1] if adapter else None,
        )  # fmt: skip
        shared = reuse.settle(identity, spec, ctx) if identity is not None else None
        if shared is not None:
            return shared
    ctx.set_phase(Phase.READ, unit="tensors")
    with open_checkpoint(checkpoint_dir) as checkpoint:
        if adapter is not None and spec.merge:
            _merge_adapter(checkpoint, adapter[0], ctx)
        elif adapter is not None:
            _keep_adapter(checkpoint, adapter[0], ctx)
        summaries, digests, model_info = _export_checkpoint(checkpoint, spec, ctx, layout)
    if adapter is not None:
        source_info = {**source_info, "adapter": ctx.details["source"]["adapter"]}
    staged = sorted(p for p in layout.staging.rglob("*") if p.is_file())
    # + the model card and the manifest
    ctx.set_phase(Phase.FINALIZE, total=len(staged) + 2, unit="files")
    artifacts = _describe_files(layout.staging, staged, digests, ctx)
    manifest = {
        "job_id": ctx.job_id,
        "source": source_info,
        "recipe": spec.stored(),
        "model": model_info,
        "exports": summaries,
        "memory": _memory_summary(ctx),
        "files": [a.__dict__ for a in artifacts],
    }
    card = layout.staging / CARD
    atomic_write_text(card, render_card(manifest, tool_versions()))
    artifacts.append(Artifact(CARD, card.stat().st_size, sha256_file(card)))
    manifest["files"] = [a.__dict__ for a in artifacts]
    ctx.advance(1)
    atomic_write_json(layout.staging / MANIFEST, manifest)
    manifest_path = layout.staging / MANIFEST
    artifacts.append(
        Artifact(MANIFEST, manifest_path.stat().st_size, sha256_file(manifest_path))
    )
    ctx.advance(1)
    fsync_tree(layout.staging)
    layout.publish()
    publish_to_store(layout, artifacts, spec, ctx, tenant)
    return artifacts


def publish_to_store(
    layout: JobLayout,
    artifacts: list[Artifact],
    spec: JobSpec,
    ctx: JobContext,
    tenant: str | None,
) -> None:
    """With an artifact store: upload the published files (manifest last) to
    ``<prefix>/<tenant>/<job id>/`` or the job's destination, record where in the job's
    ``artifact_store`` section, and free the local copy (API and workers share no disk)."""
    store = ArtifactStore.configured(ctx.settings)
    if store is None:
        return
    location = store.location_for(ctx.job_id, tenant, spec.destination)
    total = sum(a.size for a in artifacts)
    ctx.set_phase(Phase.FINALIZE, total=total, unit="bytes")
    digests = {a.path: a.sha256 for a in artifacts if a.path != MANIFEST}
    etags = store.publish(layout.artifacts, location, digests, ctx)
    ctx.set_detail("artifact_store", {"uri": location.uri, "objects": len(etags)})
    ctx.add_metric("bytes_published", total)
    layout.remove_artifacts()


def _memory_summary(ctx: JobContext) -> dict[str, Any]:
    """The manifest's ``memory``: the limit, the job's budget, how it was held, and the peak of
    each phase that ended (this process's RSS; the job cgroup's charge where there is one)."""
    memory: dict[str, Any] = dict(ctx.details.get("memory") or {})
    memory["phases"] = [
        {"phase": entry.phase.value, **entry.peaks()}
        for entry in ctx.phases
        if entry.seconds is not None
    ]
    return memory


def _download(
    request: SourceRequest, ctx: JobContext
) -> tuple[Path, dict[str, Any], ResolvedSource]:
    """DOWNLOAD (entered by the caller): the checkpoint as a local directory, the manifest's
    ``source`` section, and what the fetcher resolved."""
    resolved = fetch_source(request, ctx.settings, ctx)
    source_info: dict[str, Any] = {
        **ctx.details.get("source", {}),  # what the fetcher published (files, format, ...)
        "uri": resolved.uri,
        "cache_hit": resolved.cache_hit,
    }
    if resolved.revision:
        source_info["revision"] = resolved.revision
    ctx.set_detail("source", source_info)
    ctx.check_abort()
    return resolved.path, source_info, resolved


def _identify(
    request: SourceRequest,
    adapter_request: SourceRequest | None,
    ctx: JobContext,
    fetched: ResolvedSource | None = None,
    adapter_fetched: ResolvedSource | None = None,
) -> tuple[SourceIdentity | None, SourceRequest | None]:
    """The identity of what the job reads: the source's, and with an adapter both (``<source
    key>+adapter:<adapter key>``, so result reuse keys on the adapter too), or None while one
    of them is known only once downloaded; and the adapter's request pinned as identified."""
    identity = identify_source(request, ctx.settings, ctx, fetched=fetched)
    if adapter_request is None or identity is None:
        return identity, adapter_request
    adapter = identify_adapter(adapter_request, ctx.settings, ctx, fetched=adapter_fetched)
    if adapter is None:
        return None, adapter_request
    combined = SourceIdentity(f"{identity.key}+adapter:{adapter.key}", identity.request)
    return combined, adapter.request


def _download_adapter(
    request: SourceRequest, ctx: JobContext
) -> tuple[Path, ResolvedSource]:
    """DOWNLOAD of the job's adapter: its local directory, recorded in the ``source`` section's
    ``adapter``."""
    source = dict(ctx.details.get("source", {}))
    resolved = fetch_adapter(request, ctx.settings, ctx)
    info: dict[str, Any] = {"uri": resolved.uri, "cache_hit": resolved.cache_hit}
    if resolved.revision:
        info["revision"] = resolved.revision
    ctx.set_detail("source", {**source, "adapter": info})
    ctx.check_abort()
    path = resolved.path if resolved.path.is_dir() else resolved.path.parent
    return path, resolved


def _merge_adapter(checkpoint: Checkpoint, adapter_dir: Path, ctx: JobContext) -> None:
    """READ: the checkpoint's reader serves the adapter merged into every weight it targets
    (``service.checkpoint.lora``); the independent reference merges it with PEFT."""
    from service.checkpoint.lora import LoraMergeReader, open_adapter

    adapter = open_adapter(adapter_dir)
    checkpoint.reader = LoraMergeReader(checkpoint.reader, adapter)
    checkpoint.adapter_root = adapter_dir
    _adapter_detail(adapter.plan, True, ctx)


def _keep_adapter(checkpoint: Checkpoint, adapter_dir: Path, ctx: JobContext) -> None:
    """READ with ``"merge": false``: the reader serves the base; the adapter is judged against
    it as a merge would be (:class:`AdapterMismatch` naming the first module) and handed to the
    exports that write it apart."""
    from service.checkpoint.lora import check_adapter_matches, plan_adapter

    plan = plan_adapter(adapter_dir)
    reader = checkpoint.reader
    shapes: dict[str, Any] = {i.name: i.shape for i in reader.tensor_infos()}
    for alias, canonical in reader.aliases().items():
        shapes.setdefault(alias, shapes.get(canonical, ()))
    check_adapter_matches(plan, shapes)
    checkpoint.unmerged_adapter = adapter_dir
    _adapter_detail(plan, False, ctx)


def _adapter_detail(plan: AdapterPlan, merged: bool, ctx: JobContext) -> None:
    """The job's ``adapter`` section: what the adapter is and whether it was merged."""
    ctx.set_detail("adapter", {
        "peft_type": "LORA",
        "merged": merged,
        "modules": len(plan.targets),
        "r": plan.config.get("r"),
        "lora_alpha": plan.config.get("lora_alpha"),
        "use_rslora": bool(plan.config.get("use_rslora", False)),
        "base_model": plan.config.get("base_model_name_or_path"),
    })  # fmt: skip


def _export_checkpoint(
    checkpoint: Checkpoint, spec: JobSpec, ctx: JobContext, layout: JobLayout
) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, Any]]:
    """READ, BUILD, OFFLOAD, EXPORT, VERIFY: what each export declares it needs
    (:class:`Needs`) is prepared once for all of them, then each export runs."""
    exporters = registry()
    infos = checkpoint.reader.tensor_infos()
    ctx.advance(len(infos))
    counts: dict[str, Any] = {
        "format": checkpoint.format,
        "tensor_count": len(infos),
        "parameter_count": sum(i.numel for i in infos),
        "bytes": sum(i.nbytes for i in infos),
    }
    if checkpoint.quantization is not None:
        counts["quantization"] = checkpoint.quantization
        _present_config(checkpoint, layout)
    specs = spec.export_specs()
    if not spec.verify:  # the job's "verify": false also skips the exporters' own checks
        specs = [
            s.model_copy(update={"verify": False}) if "verify" in type(s).model_fields else s
            for s in specs
        ]
    for export in specs:
        # what submission judged for a local source, now that every source's files are here
        exporters[export.format].check_files(
            export, checkpoint.config, checkpoint.root, ctx.settings
        )
    needs = [_job_needs(exporters[s.format].needs(s), spec) for s in specs]
    model = _build(checkpoint, spec, specs, needs, ctx, counts)
    needs_module = any(n.module for n in needs)
    # Exporters that rewrite modules copy the one meta build; dispatch fills the original.
    skeleton = copy.deepcopy(model.model) if model and needs_module else None
    session = None
    if model is not None:
        session = _ModelSession.open(
            checkpoint, model, spec, ctx,
            needs_store=needs_module, needs_reference=any(n.reference for n in needs),
            needs_independent=any(n.independent for n in needs),
        )  # fmt: skip
    failed = True
    try:
        inputs = ExportInputs(
            checkpoint=checkpoint,
            model=model.model if model else None,
            skeleton=skeleton,
            store=session.store if session else None,
            reference=session.reference if session else None,
            independent=session.independent if session else None,
            max_memory=spec.max_memory or ctx.settings.offload_memory,
            verify_text=None if spec.verify_text is None else check_text(spec.verify_text),
        )
        summaries, digests = _export_all(specs, inputs, layout, ctx)
        _verify_all(specs, needs, summaries, inputs, layout, ctx)
        failed = False
    finally:
        if session is not None:
            session.close(failed)
    return summaries, digests, {**counts, **ctx.details.get("model", {})}


def _present_config(checkpoint: Checkpoint, layout: JobLayout) -> None:
    """The config.json exports carry over, as the readers present the checkpoint: once its
    quantization is handled (FP8 dequantized, a contradicted config ignored) the weights are
    float, and a ``quantization_config`` beside them would make a consumer misread them. The
    rewritten file lives in the job's work directory; the source is never modified."""
    if checkpoint.config is None:
        return
    for i, path in enumerate(checkpoint.aux_files):
        if path.name == "config.json":
            presented = layout.work / "source-config" / "config.json"
            presented.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(presented, checkpoint.config)
            checkpoint.aux_files[i] = presented
            checkpoint.rewritten.append(presented)


def _job_needs(needs: Needs, spec: JobSpec) -> Needs:
    """An export's needs within this job: no reference when the job is not verified."""
    return needs if spec.verify else dataclasses.replace(needs, reference=False, independent=False)


def _build(
    checkpoint: Checkpoint,
    spec: JobSpec,
    specs: list[ExportSpec],
    needs: list[Needs],
    ctx: JobContext,
    counts: dict[str, Any],
) -> BuiltModel | None:
    """BUILD: the architecture on meta with a keys report. Without a usable config.json the job
    still runs every state-dict-level export; only what needs a module is refused."""
    from service.offload.build import build_phase

    needs_module = [s.format for s, n in zip(specs, needs, strict=True) if n.module]
    built = build_phase(checkpoint, ctx.settings, ctx, dtype=_compute_dtype(spec))
    ctx.set_detail("model", {**counts, **ctx.details.get("model", {})})
    if built is None and needs_module:
        raise NoModelConfig(
            f"exports {needs_module} need the model's architecture, but the checkpoint has no "
            "usable config.json"
        )
    return built


def _compute_dtype(spec: JobSpec) -> Any:
    import torch

    # Verification compares in float32 whatever the checkpoint's dtype.
    return torch.float32 if spec.verify else None


def _export_all(
    specs: list[ExportSpec], inputs: ExportInputs, layout: JobLayout, ctx: JobContext
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """EXPORT: each export into its own staging directory; the checkpoint is read once per
    export, tensor by tensor."""
    exporters = registry()
    summaries: list[dict[str, Any]] = []
    digests: dict[str, str] = {}
    for export, dirname in zip(specs, export_dirs(specs), strict=True):
        ctx.check_abort()
        out_dir = layout.staging / dirname
        out_dir.mkdir(parents=True, exist_ok=True)
        result = exporters[export.format].export(export, inputs, out_dir, ctx)
        release_between_stages()
        for rel, digest in result.digests.items():
            digests[f"{dirname}/{rel}"] = digest
        summaries.append(
            {"format": export.format, "dir": dirname, "spec": export.model_dump(mode="json"),
             **result.summary}
        )
    return summaries, digests


@dataclass
class _ModelSession:
    """The job's one offload store and its dispatched model, used to compute the source's
    reference outputs once for every export that is verified against them."""

    checkpoint: Checkpoint
    store: OffloadStore | None
    ctx: JobContext
    max_memory: str
    reference: Any = None
    independent: Any = None
    """transformers' reading of the source
    (:class:`service.verification.independent.IndependentReference`)."""

    @classmethod
    def open(
        cls,
        checkpoint: Checkpoint,
        built: BuiltModel,
        spec: JobSpec,
        ctx: JobContext,
        *,
        needs_store: bool,
        needs_reference: bool,
        needs_independent: bool = False,
    ) -> _ModelSession:
        """Dispatch into the job's store when an export is verified against the source's
        outputs (``needs_reference``, within ``max_memory``) or reads the model (``needs_store``,
        all on disk: nothing of the model is loaded into RAM for it)."""
        from service.offload.dispatch import dispatch_model, publish_offload_metrics
        from service.offload.store import open_job_store

        max_memory = spec.max_memory or ctx.settings.offload_memory
        session = cls(checkpoint, None, ctx, max_memory)
        if not (needs_reference or needs_store):
            if needs_independent:  # transformers' reading alone: nothing of ours is dispatched
                ctx.set_phase(Phase.OFFLOAD, total=None, unit="bytes")
                # only the fixed text's logits are read (no model of ours to compare with)
                session.independent = _independent_reference(
                    checkpoint, type(built.model), max_memory, ctx, spec.verify_text,
                    with_outputs=False,
                )
            return session
        ctx.set_phase(Phase.OFFLOAD, total=None, unit="bytes")
        # Verified exports that read the store (NNEF, ONNX) check their files against the
        # job's model: that model is checked against transformers' reading first. transformers
        # runs (within max_memory) and lets go before the job's model is dispatched (within
        # max_memory): never both at once.
        # When transformers cannot load the source, the dispatch still runs first: our reader's
        # typed error (weights_mismatch...) names an input's fault better than its refusal.
        independent = None
        unavailable: ReferenceUnavailable | None = None
        if needs_reference or spec.verify:
            try:
                independent = _independent_reference(
                    checkpoint, type(built.model), max_memory, ctx, spec.verify_text
                )
            except ReferenceUnavailable as exc:
                unavailable = exc
        store = open_job_store(ctx.settings, ctx.job_id, checkpoint.root)
        session.store = store
        result = dispatch_model(
            built, checkpoint.reader, store, ctx,
            max_memory=max_memory if needs_reference else ALL_ON_DISK,
        )  # fmt: skip
        publish_offload_metrics(store, ctx, result)
        if unavailable is not None:
            raise unavailable
        if independent is not None:
            ours = _reference(result.model, checkpoint, ctx)
            _release_resident_weights(result.model)
            release_between_stages()
            _check_agreement(independent, ours, ctx)
            session.independent, session.reference = independent, independent.outputs
            publish_offload_metrics(store, ctx, result)
        return session

    def close(self, failed: bool) -> None:
        """Final offload figures into the job, then the store goes (kept for a failed job only
        with ``keep_failed_offload``)."""
        if self.store is not None:
            from service.offload.dispatch import publish_offload_metrics

            publish_offload_metrics(self.store, self.ctx)
            self.store.close(failed=failed)


def _verify_all(
    specs: list[ExportSpec],
    needs: list[Needs],
    summaries: list[dict[str, Any]],
    inputs: ExportInputs,
    layout: JobLayout,
    ctx: JobContext,
) -> None:
    """VERIFY: each export that asked for the source's reference outputs is checked against
    them by its exporter; the others verified themselves while exporting (or were not asked
    to). Without a buildable model there is no reference: the export says why it was skipped."""
    asked = [
        (s, n, summary)
        for s, n, summary in zip(specs, needs, summaries, strict=True)
        if n.reference or n.independent
    ]
    pending: list[tuple[ExportSpec, dict[str, Any]]] = []
    reason = ctx.details.get("model", {}).get("reason", "the model cannot be built")
    for export, need, summary in asked:
        if (need.reference and inputs.reference is None) or (
            need.independent and inputs.independent is None
        ):
            summary["verify"] = {"skipped": reason}
        else:
            pending.append((export, summary))
    if not pending:
        return
    exporters = registry()
    ctx.set_phase(Phase.VERIFY, total=len(pending), unit="exports")
    for export, summary in pending:
        out_dir = layout.staging / summary["dir"]
        summary["verify"] = exporters[export.format].verify(export, inputs, out_dir, ctx)
        release_between_stages()
        ctx.advance(1)


REFERENCE_AGREEMENT = {"whole": 1e-3, "layer-by-layer": 6e-2, "module-by-module": 6e-2}
"""Largest ``max |ours - transformers'| / max |transformers'|`` on the fixed input: float32 on
both sides (summation order only), or transformers' layer-by-layer pass in the model's dtype
(bfloat16's rounding through the layers); module by module, the same forward over the same
float32 weights as layer by layer. A misread source is off by orders of magnitude."""


def _independent_reference(
    checkpoint: Checkpoint,
    model_class: Any,
    max_memory: str,
    ctx: JobContext,
    text: str | None,
    with_outputs: bool = True,
) -> IndependentReference:
    """transformers' reading of the source (:mod:`service.verification.independent`): its outputs
    on the fixed input (unless ``with_outputs`` is False) and its logits on the fixed text (the
    request's ``verify_text`` when it has one), what every check compares against. Its model is gone (and its pages returned) when this
    returns."""
    import gc

    from service.memory.libc import malloc_trim
    from service.units import parse_size
    from service.verification.independent import independent_reference
    from service.verification.reference import fixed_input_ids

    vocab = int((checkpoint.config or {}).get("vocab_size", 0) or 0)
    ctx.check_abort()
    reference = independent_reference(
        checkpoint.root, model_class, fixed_input_ids(vocab), check_text(text),
        parse_size(max_memory),
        ctx.work_dir / "reference", adapter_dir=checkpoint.adapter_root,
        with_outputs=with_outputs,
    )  # fmt: skip
    gc.collect()
    malloc_trim()
    return reference


def _check_agreement(reference: IndependentReference, ours: Any, ctx: JobContext) -> None:
    """The job's reader and offloaded model must compute what transformers computes on the
    fixed input (:data:`REFERENCE_AGREEMENT`), or the job fails before any artifact is judged.
    The manifest's ``model.reference`` says which implementation, how it ran, how close."""
    from service.verification.parity import relative_agreement

    agreement = relative_agreement(reference.outputs, ours, REFERENCE_AGREEMENT[reference.mode])
    ctx.set_detail("model", {
        **ctx.details.get("model", {}),
        "reference": {**reference.summary(), "job_model_agreement": agreement},
    })  # fmt: skip
    if not agreement["passed"]:
        raise VerificationFailed(
            f"the job's reading of the checkpoint disagrees with transformers' from_pretrained "
            f"(relative error {agreement.get('max_rel_error', 'n/a')} > "
            f"{agreement.get('tolerance')}): {agreement.get('reason', 'outputs differ')}"
        )


def _release_resident_weights(model: Any) -> None:
    """Put the weights ``max_memory`` kept in RAM for the reference forward back on meta (the
    caller then returns their pages): once the source's outputs are computed nothing reads them
    (the exports stream from the store or the checkpoint; the module is kept for its structure
    and ties), and held through every export of the job they would add up to ``max_memory`` to
    each export's peak, the quantizer's and the consumers' included. (A float32 safetensors
    source's are its mapped pages; a cast one's, bfloat16 read as float32, are copies.) Tied
    parameters stay one object."""
    import torch

    from service.offload.tensor import StoreTensor

    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or isinstance(param, StoreTensor) or param.is_meta:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = torch.nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=False
                )
            module._parameters[name] = replaced[id(param)]


def _reference(model: Any, checkpoint: Checkpoint, ctx: JobContext) -> Any:
    from service.offload.streaming import streamed_forward
    from service.verification.reference import fixed_input_ids

    vocab = int((checkpoint.config or {}).get("vocab_size", 0) or 0)
    input_ids = fixed_input_ids(vocab)
    ctx.check_abort()
    output, _stats = streamed_forward(
        model,
        {"input_ids": input_ids, "attention_mask": input_ids.new_ones(input_ids.shape)},
        check_abort=ctx.check_abort,
    )
    return output.float()


def _describe_files(
    root: Path, files: list[Path], digests: dict[str, str], ctx: JobContext
) -> list[Artifact]:
    artifacts = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        digest = digests.get(rel) or sha256_file(path)
        artifacts.append(Artifact(rel, path.stat().st_size, digest))
        ctx.advance(1)
    return artifacts
