"""The job operations the API (and the CLI) call; no HTTP here, no pipeline internals."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from service.config import Settings
from service.errors import ArtifactGone, ArtifactNotFound, Conflict, TenantLimitExceeded
from service.jobs.executors.base import Executor
from service.jobs.layout import JobLayout
from service.jobs.model import Job, JobStatus, Phase
from service.jobs.pipeline import check_spec
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore, utcnow
from service.sources import fetcher_for
from service.sources.local import LocalFetcher


@dataclass
class JobService:
    settings: Settings
    store: JobStore
    executor: Executor

    def submit(self, spec: JobSpec, tenant: str | None = None) -> Job:
        """Validate what can be known now (422 rather than a failed job), check the tenant's
        limits (429), then queue."""
        known, config = self._local_config(spec)
        check_spec(spec, self.settings, config, config_known=known)
        if tenant is not None:
            self._check_tenant_limits(tenant)
        job = Job(
            id=uuid.uuid4().hex,
            status=JobStatus.QUEUED,
            phase=Phase.QUEUED,
            spec=spec.stored(),
            created_at=utcnow(),
            tenant=tenant,
        )
        secrets = {"hf_token": spec.hf_token.get_secret_value()} if spec.hf_token else {}
        return self.executor.submit(job, secrets)

    def _check_tenant_limits(self, tenant: str) -> None:
        """TenantLimitExceeded when ``tenant`` keeps its limit of artifact bytes.

        The job-count limits (queued, active) are exact: the store checks them inside the
        insert's transaction (:class:`service.jobs.store.Admission`)."""
        settings = self.settings
        if settings.tenant_max_artifact_bytes is not None:
            used = self.artifact_bytes(tenant)
            if used >= settings.tenant_max_artifact_bytes:
                raise TenantLimitExceeded(
                    f"tenant {tenant} keeps {used} artifact bytes (limit "
                    f"{settings.tenant_max_artifact_bytes}); free space before submitting",
                    retry_after=3600,
                )

    def artifact_bytes(self, tenant: str | None = None) -> int:
        """Bytes of the artifacts of succeeded jobs (of ``tenant``, or of everyone)."""
        total = 0
        before: tuple[datetime, str] | None = None
        while True:
            page = self.store.page(
                status=JobStatus.SUCCEEDED, tenant=tenant, limit=500, before=before
            )
            total += sum(a.size for job in page for a in job.artifacts)
            if len(page) < 500:
                return total
            before = (page[-1].created_at, page[-1].id)

    def _local_config(self, spec: JobSpec) -> tuple[bool, dict[str, Any] | None]:
        """(known, config.json) of the source: known only for file:// sources, whose config an
        exporter can judge at once (None when absent or unusable, as the job will see it)."""
        fetcher = fetcher_for(spec.source)
        if not isinstance(fetcher, LocalFetcher):
            return False, None
        path = fetcher.path(spec.source_request(), self.settings)
        config_path = path / "config.json" if path.is_dir() else path.parent / "config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # deeply nested JSON recurses
            return True, None
        return True, config if isinstance(config, dict) else None

    def get(self, job_id: str, tenant: str | None = None) -> Job:
        return self.store.get(job_id, tenant)

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
        freed = layout.disk_bytes()
        job = self.store.mark_deleted(job_id, freed, tenant)
        if job is None:
            raise Conflict(f"job {job_id} is not finished; cancel it first")
        layout.remove()
        return job

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

    def artifact(self, job_id: str, path: str, tenant: str | None = None) -> tuple[Job, Path]:
        """The job and the file of one of its artifacts; only succeeded jobs have artifacts."""
        job = self.store.get(job_id, tenant)
        if "deleted_at" in job.details:
            raise ArtifactGone(f"the artifacts of job {job_id} were removed")
        if job.status is not JobStatus.SUCCEEDED:
            raise ArtifactNotFound(f"job {job_id} has no artifacts ({job.status.value})")
        return job, JobLayout.for_job(self.settings, job_id).artifact(path)

