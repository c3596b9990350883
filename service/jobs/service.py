"""The job operations the API (and the CLI) call, and the checks a spec passes at submission
(:func:`check_spec`); no HTTP here, no pipeline internals."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio.to_thread

from service.checkpoint.consistency import check_config_matches_weights, safetensors_tensors
from service.checkpoint.headers import CheckpointHeaders
from service.checkpoint.lora import check_adapter_matches, plan_adapter
from service.checkpoint.quantization import plan_quantization, without_quantization
from service.config import Settings
from service.errors import (
    ArtifactGone,
    ArtifactNotFound,
    CheckpointError,
    ConfigurationError,
    Conflict,
    InvalidRequest,
    PlanDoesNotFit,
    SourceError,
    UnmergedAdapterUnsupported,
)
from service.exporters import registry
from service.jobs.artifact_store import ArtifactStore, check_destination
from service.jobs.callbacks import check_callback, waiting_callback
from service.jobs.executors.base import Executor
from service.jobs.layout import JobLayout
from service.jobs.model import Job, JobStatus, Phase
from service.jobs.planning import plan_spec, source_headers
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore, utcnow
from service.objectstore import S3Location
from service.offload.usage import OFFLOAD_COUNTERS, offload_usage
from service.plan import JobPlan
from service.sources import LocalSource, check_source, local_source
from service.sources.adapter import check_adapter_source, is_http


def _check_quantization(headers: CheckpointHeaders) -> None:
    """:class:`UnsupportedQuantization` for a checkpoint whose config.json and tensor headers
    show a quantization the readers do not implement (``service.checkpoint.quantization``).
    Only judged where the tensors are known (safetensors): a method over float tensors is a
    stale config, ignored, and only the tensors can say so."""
    if headers.format != "safetensors" or not headers.tensors:
        return
    plan_quantization(headers.config, {t.name: (t.dtype, t.shape) for t in headers.tensors})


def check_spec(
    spec: JobSpec,
    settings: Settings,
    config: dict[str, Any] | None,
    *,
    config_known: bool,
    source_dir: Path | None = None,
    source_checked: bool = False,
) -> None:
    """Everything knowable before running: source allowed, each export possible.

    ``config_known`` is False when the checkpoint is not local yet (hub, HTTP): exporters then
    check their spec in the job, once the config is there, rather than refusing a config that
    is merely not downloaded. ``source_dir``, a local checkpoint's directory, lets an exporter
    also judge its files (a tokenizer, say). ``source_checked``: the caller resolved the
    source already (a local one, :func:`service.sources.local_source`), which checked it."""
    if not source_checked:
        check_source(spec.source_request(), settings)
    exporters = registry()
    for export in spec.export_specs():
        exporters[export.format].check_request(export, settings)
    _check_adapter_use(spec)
    if not config_known:
        return
    for export in spec.export_specs():
        if source_dir is not None:
            exporters[export.format].check_files(export, config, source_dir, settings)
        else:
            exporters[export.format].check(export, config, settings)


def _check_headers(spec: JobSpec, headers: CheckpointHeaders, settings: Settings) -> None:
    """Each export judged on a remote source's headers (``Exporter.check_headers``): what its
    config and tensor names refuse is refused at submission, not after the download."""
    exporters = registry()
    for export in spec.export_specs():
        exporters[export.format].check_headers(export, headers, settings)


def _check_adapter_use(spec: JobSpec) -> None:
    """An export that writes the adapter apart needs one kept apart (an adapter, ``"merge":
    false``); with ``"merge": false`` every export must be one that does
    (:class:`UnmergedAdapterUnsupported` names the first that is not)."""
    exporters = registry()
    for i, export in enumerate(spec.export_specs()):
        unmerged = exporters[export.format].takes_unmerged_adapter(export)
        if unmerged and (spec.adapter is None or spec.merge):
            raise InvalidRequest(
                f"exports[{i}] ({export.format}) writes the job's adapter unmerged: it needs "
                '"adapter" and "merge": false'
            )
        if not unmerged and spec.adapter is not None and not spec.merge:
            raise UnmergedAdapterUnsupported(
                f'exports[{i}] ({export.format}) cannot take an unmerged adapter ("merge": '
                'false); only {"format": "gguf", "lora": true} writes one, beside the base'
            )


@dataclass
class JobService:
    settings: Settings
    store: JobStore
    executor: Executor

    def submit(self, spec: JobSpec, tenant: str | None = None) -> Job:
        """Validate what can be known now (422 rather than a failed job), check the tenant's
        limits (429), then queue."""
        local = self._check_request(spec)
        check_callback(spec, self.settings, tenant)
        if spec.destination is not None:
            if ArtifactStore.configured(self.settings) is None:
                raise InvalidRequest('"destination" needs an artifact store '
                                     "(MODELPREP_ARTIFACT_STORE)")
            check_destination(spec.destination, tenant, self.settings)
        if local is not None:
            self._check_plan(spec)
        else:
            self._check_remote_headers(spec)
        job = Job(
            id=uuid.uuid4().hex,
            status=JobStatus.QUEUED,
            phase=Phase.QUEUED,
            spec=spec.stored(),
            created_at=utcnow(),
            tenant=tenant,
            callback=waiting_callback(spec),
            reserved_bytes=self._reservation(spec, local) if tenant is not None else 0,
        )
        secrets = {"hf_token": spec.hf_token.get_secret_value()} if spec.hf_token else {}
        return self.executor.submit(job, secrets)

    def _check_request(self, spec: JobSpec) -> LocalSource | None:
        """What submit and plan both check before anything else: the source (a local one is
        resolved once, under the allowed roots, readable: every check judges that one path),
        each export against it, and the adapter. The resolved local source, if any."""
        local = local_source(spec.source_request(), self.settings)
        config = self._check_local_weights(local) if local is not None else None
        check_spec(
            spec, self.settings, config, config_known=local is not None,
            source_dir=local.directory if local is not None else None,
            source_checked=local is not None,
        )  # fmt: skip
        if spec.adapter is not None:
            self._check_adapter(spec, local)
        return local

    def _check_plan(self, spec: JobSpec) -> None:
        """Refuse a job whose plan does not fit (:class:`PlanDoesNotFit`): a local checkpoint's
        headers cost nothing to read, so a job that cannot fit is refused now, not OOM-killed
        or out of disk after minutes of work. A checkpoint whose headers cannot be read is left
        to the job, which names what is wrong with it (as it did before plans)."""
        try:
            headers = source_headers(spec, self.settings)
        except (CheckpointError, SourceError, OSError):
            return
        plan = plan_spec(spec, headers, self.settings)
        if not plan.fits:
            raise PlanDoesNotFit("; ".join(plan.refusals) + ' (see "dry_run": true)')

    def _check_remote_headers(self, spec: JobSpec) -> None:
        """Refuse now (422, :class:`UnsupportedQuantization` naming the method) a remote
        checkpoint quantized in a way the readers do not implement, as a local one is: a hub
        commit's or an S3 prefix's config.json and safetensors headers are a few range reads,
        and a GPTQ model must not be downloaded only to fail; then each export's judgement of
        the same headers (:func:`_check_headers`: a VLM layout GGUF cannot take, say). Sources that do not describe
        themselves (an HTTP file has no config.json, a pickle no headers) or cannot be reached
        now are left to the job, which fails with the same error."""
        try:
            headers = source_headers(spec, self.settings)
        except (CheckpointError, SourceError, OSError):
            return
        _check_quantization(headers)
        _check_headers(spec, headers, self.settings)

    def plan(self, spec: JobSpec, tenant: str | None = None) -> JobPlan:
        """What the job would hold in memory and write to disk, and whether it fits, from the
        source's headers (a remote source's too: range reads, never the weights); checked as
        :meth:`submit` checks a job, but nothing is queued."""
        local = self._check_request(spec)
        headers = source_headers(spec, self.settings)
        _check_quantization(headers)
        if local is None:
            _check_headers(spec, headers, self.settings)
        return plan_spec(spec, headers, self.settings)

    def _check_adapter(self, spec: JobSpec, local: LocalSource | None) -> None:
        """The adapter's source is allowed; a local adapter is a LoRA adapter that can be
        merged, and on a local safetensors source it is checked against the source's headers:
        a module it targets missing or of another shape is refused now (adapter_mismatch)."""
        request = spec.adapter_request()
        assert request is not None
        adapter = local_source(request, self.settings) if not is_http(request) else None
        if adapter is None:
            check_adapter_source(request, self.settings)
            return
        plan = plan_adapter(adapter.directory)
        tensors = safetensors_tensors(local.directory) if local is not None else None
        if tensors is not None:
            check_adapter_matches(plan, {n: shape for n, (_, shape) in tensors.items()})

    def _reservation(self, spec: JobSpec, local: LocalSource | None) -> int:
        """The artifact bytes a job is expected to write, held against its tenant's limit
        while it waits and runs: the size of a local source's files once per export (each
        format writes the weights once; quantized GGUF writes less, so this errs on the safe
        side). Nothing for a remote source, whose size is known only once downloaded: its real
        size is checked when it ends (:func:`service.jobs.store.lifecycle.finish`)."""
        if self.settings.tenant_max_artifact_bytes is None or local is None:
            return 0
        size = local.size_bytes()
        return 0 if size is None else size * len(spec.exports)

    def artifact_bytes(self, tenant: str | None = None) -> int:
        """Bytes of the artifacts of succeeded jobs still on disk (of ``tenant``, or of
        everyone): one read of the store's totals, however many jobs there are."""
        return self.store.artifact_bytes(tenant)

    def _check_local_weights(self, local: LocalSource) -> dict[str, Any] | None:
        """The config.json of a local checkpoint as the job's readers will present it (a
        handled ``quantization_config`` dropped), which is what the exporters judge.

        A local safetensors checkpoint whose config.json disagrees with its headers, or that
        is quantized in a way the readers do not implement, is refused now (422) rather than
        as a failed job: the headers are a few kilobytes."""
        config = local.config()
        tensors = safetensors_tensors(local.directory)
        if tensors is None:
            return config
        plan = plan_quantization(config, tensors)  # UnsupportedQuantization names the method
        if config is not None:
            shapes = {n: shape for n, (_, shape) in tensors.items() if n not in plan.hidden}
            check_config_matches_weights(config, shapes)
        return config if plan.handling == "none" else without_quantization(config)

    def get(self, job_id: str, tenant: str | None = None) -> Job:
        return self.store.get(job_id, tenant)

    async def get_on_loop(self, job_id: str, tenant: str | None = None) -> Job:
        """:meth:`get` for a caller on an event loop, which must never stall on the database.

        Inline when the store's reads never wait (SQLite): a point read costs less than a hop
        to a worker thread, which on a busy machine also costs two thread wake-ups and GIL
        hand-overs per request (bench/api_latency.py). In a worker thread otherwise: a network
        database may stall, and the event loop must not stall with it."""
        if self.store.reads_never_wait:
            return self.get(job_id, tenant)
        return await anyio.to_thread.run_sync(self.get, job_id, tenant)

    def readiness(self) -> dict[str, str]:
        """Whether this process can serve jobs: each check's name and ``ok`` or what is wrong.
        Never raises: a readiness probe reports a broken database, it does not crash on it."""
        checks: dict[str, str] = {}
        try:
            self.store.ping()
            checks["database"] = "ok"
        except Exception as exc:  # noqa: BLE001 - readiness reports any failure, never raises
            checks["database"] = f"error: {type(exc).__name__}"
        checks["data_dir"] = "ok" if self.settings.data_dir.is_dir() else "missing"
        return checks

    def page(
        self,
        status: JobStatus | None,
        limit: int,
        before: tuple[datetime, str] | None,
        tenant: str | None = None,
    ) -> list[Job]:
        return self.store.page(status=status, tenant=tenant, limit=limit, before=before)

    def cancel(self, job_id: str, tenant: str | None = None) -> Job:
        return self.executor.cancel(job_id, tenant)

    def delete(self, job_id: str, tenant: str | None = None) -> Job:
        """``DELETE``: cancel a queued or running job; remove a finished one's files."""
        job = self.store.get(job_id, tenant)
        if not job.status.terminal:
            try:
                return self.executor.cancel(job_id, tenant)
            except Conflict:
                pass  # it finished meanwhile: its files go instead
        return self.remove_files(job_id, tenant)

    def remove_files(self, job_id: str, tenant: str | None = None) -> Job:
        """Remove a finished job's artifacts and work files; its row stays as a tombstone
        (``deleted_at``, ``metrics.artifact_bytes_freed``) and its artifact URLs answer 410.

        The row is marked first, so no client is handed a URL to a file being removed."""
        layout = JobLayout.for_job(self.settings, job_id)
        location = published_location(self.store.get(job_id, tenant))
        freed = layout.disk_bytes()
        if location is not None:
            freed += self._artifact_store().size(location)
        job = self.store.mark_deleted(job_id, freed, tenant)
        if job is None:
            raise Conflict(f"job {job_id} is not finished; cancel it first")
        if location is not None:
            self._artifact_store().remove(location)
        layout.remove()
        return job

    def _artifact_store(self) -> ArtifactStore:
        store = ArtifactStore.configured(self.settings)
        if store is None:
            raise ConfigurationError(
                "a job published to the artifact store, but MODELPREP_ARTIFACT_STORE is unset"
            )
        return store

    def expire_artifacts(self, batch: int = 100) -> list[str]:
        """Remove the files of jobs finished more than ``artifact_ttl`` ago; returns their ids.

        Bounded work per call (``batch`` jobs, found by an indexed query)."""
        if self.settings.artifact_ttl is None:
            return []
        cutoff = utcnow() - timedelta(seconds=self.settings.artifact_ttl)
        expired = self.store.expired(cutoff, batch)
        for job_id in expired:
            self.remove_files(job_id)
        return expired

    def abort_orphaned_uploads(self) -> int | None:
        """Abort the artifact store's multipart uploads left by publishes that failed long
        ago (:meth:`ArtifactStore.abort_orphaned_uploads`); 0 without an artifact store."""
        store = ArtifactStore.configured(self.settings)
        return 0 if store is None else store.abort_orphaned_uploads()

    def artifact(self, job_id: str, path: str, tenant: str | None = None) -> tuple[Job, Path]:
        """The job and the file of one of its artifacts; only succeeded jobs have artifacts."""
        job = self.store.get(job_id, tenant)
        if job.deleted_at is not None:
            raise ArtifactGone(f"the artifacts of job {job_id} were removed")
        if job.status is not JobStatus.SUCCEEDED:
            raise ArtifactNotFound(f"job {job_id} has no artifacts ({job.status.value})")
        return job, JobLayout.for_job(self.settings, job_id).artifact(path)

    def offload_usage(self) -> dict[str, Any]:
        """``/v1/offload``: the stores on this host's disk, plus those running jobs report
        through the database from other hosts (workers with no shared volume)."""
        usage = offload_usage(self.settings)
        reported = False
        for job in self.store.page(status=JobStatus.RUNNING, limit=1000):
            figures = job.details.get("offload_usage")
            if job.id not in usage["jobs"] and isinstance(figures, dict):
                usage["jobs"][job.id] = {**figures, "reported": True}
                reported = True
        if reported:
            jobs = usage["jobs"].values()
            usage["total"] = {
                **{key: sum(int(j.get(key, 0)) for j in jobs) for key in OFFLOAD_COUNTERS},
                "stores": len(usage["jobs"]),
            }
        return usage

    def artifact_url(self, job_id: str, path: str, tenant: str | None = None) -> str | None:
        """A presigned URL of an artifact published to the artifact store (None: the job's
        artifacts are on local disk; :meth:`artifact` serves them). Only paths the job lists."""
        job = self.store.get(job_id, tenant)
        location = published_location(job)
        if location is None:
            return None
        if job.deleted_at is not None:
            raise ArtifactGone(f"the artifacts of job {job_id} were removed")
        if path not in {a.path for a in job.artifacts}:
            raise ArtifactNotFound(f"no artifact {path!r}")
        return self._artifact_store().url(location, path)


def published_location(job: Job) -> S3Location | None:
    """Where the job's artifacts were published in the artifact store, if they were."""
    section = job.details.get("artifact_store")
    if isinstance(section, dict) and isinstance(section.get("uri"), str):
        return S3Location.parse(section["uri"])
    return None
