"""/v1/offload with workers that share no disk with the API: each running job reports its
offload store's figures through the database, and the API adds those it cannot see."""

from __future__ import annotations

import uuid
from pathlib import Path

from service.config import Settings
from service.jobs.model import Job, JobStatus, Phase
from service.jobs.runner import StoreContext
from service.jobs.service import JobService
from service.jobs.store import JobStore, utcnow
from service.offload.paths import job_store_dir


def _running(store: JobStore) -> str:
    job_id = uuid.uuid4().hex
    store.create(Job(id=job_id, status=JobStatus.QUEUED, phase=Phase.QUEUED,
                     spec={"source": "s3://b/m", "exports": []}, created_at=utcnow()))
    assert store.claim(job_id, "worker-host:1") is not None
    return job_id


def test_a_worker_job_reports_its_offload_store_and_the_api_lists_it(
    tmp_path: Path, store: JobStore
) -> None:
    worker = Settings(data_dir=tmp_path / "worker")
    api = Settings(data_dir=tmp_path / "api")
    job_id = _running(store)
    offload = job_store_dir(worker.jobs_dir, job_id)
    offload.mkdir(parents=True)
    (offload / "tensor.bin").write_bytes(b"x" * 8192)

    ctx = StoreContext(job_id=job_id, settings=worker, work_dir=tmp_path / "work", store=store)
    ctx.flush(force=True)
    reported = store.get(job_id).details["offload_usage"]
    assert reported["files"] == 1 and reported["bytes_on_disk"] >= 8192

    usage = JobService(api, store, executor=None).offload_usage()  # type: ignore[arg-type]
    assert usage["jobs"][job_id]["reported"] is True
    assert usage["jobs"][job_id]["files"] == 1
    assert usage["total"]["stores"] == 1 and usage["total"]["files"] == 1
