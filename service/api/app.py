"""The application factory: settings in, a ready FastAPI app out."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.auth import KEY_REQUIRED, Keyring
from service.api.errors import install_error_handlers
from service.api.metrics import service_registry
from service.api.routes import artifacts, docs, events, health, jobs, metrics, offload, ui
from service.api.schemas import job_json
from service.api.telemetry import RequestTelemetry, request_latency_histogram
from service.api.watch import JobWatch
from service.config import Settings, outbound_line
from service.fsutil import ensure_writable_dir
from service.jobs.callbacks import CallbackDeliverer
from service.jobs.executors import executor_for
from service.jobs.service import JobService
from service.jobs.store import JobStore
from service.objectstore import outbound_report

log = logging.getLogger(__name__)

API_DESCRIPTION = """\
Submit a job (`POST /v1/jobs`) naming a checkpoint and the exports to make; follow it
(`GET /v1/jobs/{id}`, or the live `GET /v1/jobs/{id}/events` stream); download its artifacts
(`GET /v1/jobs/{id}/artifacts/{path}`, listed with their sha256 in the job). Every `/v1` route
takes `Authorization: Bearer <key>` unless the service runs without keys on loopback. Every error
is `application/problem+json` whose `type` is a page of this service (`/problems/<code>`).
"""


async def _housekeeping(jobs: JobService, settings: Settings) -> None:
    """At start, then every ``retention_interval_seconds``: abort the artifact store's orphaned
    multipart uploads (``MODELPREP_ARTIFACT_UPLOAD_ORPHAN_AFTER``), and remove the files of
    jobs finished longer ago than ``MODELPREP_ARTIFACT_TTL``. Every API process may run both:
    aborting an upload or removing a job's files twice is harmless (the tombstone is written
    once)."""
    if settings.artifact_ttl is None and settings.artifact_store is None:
        return
    while True:
        try:
            if await asyncio.to_thread(jobs.abort_orphaned_uploads) is None:
                log.warning("some orphaned multipart uploads could not be aborted; next round")
        except Exception:  # a store hiccup must not end housekeeping; the next round retries
            log.exception("aborting orphaned multipart uploads failed")
        try:
            while await asyncio.to_thread(jobs.expire_artifacts):
                pass  # a full batch: there may be more
        except Exception:  # a store hiccup must not end retention; the next round retries
            log.exception("artifact retention failed")
        await asyncio.sleep(settings.retention_interval_seconds)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the only place (with the CLI) where settings are read."""
    settings = settings or Settings()
    ensure_writable_dir(settings.data_dir, "MODELPREP_DATA_DIR")
    ensure_writable_dir(settings.jobs_dir, "MODELPREP_DATA_DIR")
    outbound = outbound_report(settings)
    log.info("outbound connections: %s", outbound_line(outbound), extra={"outbound": outbound})
    store = JobStore.from_url(settings.sqlalchemy_url)
    executor = executor_for(settings, store)
    job_service = JobService(settings=settings, store=store, executor=executor)
    # Every API process delivers completion callbacks (workers too): whoever looks first.
    deliverer = CallbackDeliverer(settings, store, render=job_json)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store.create_schema()
        executor.start()
        deliverer.start()
        # What start-up built (imported modules, the app, its schemas) lives as long as the
        # process: keep it out of the collector's full passes, which otherwise walk some 250k
        # objects and stop every thread for 0.2-0.3 s, about once a minute under load.
        gc.collect()
        gc.freeze()
        retention = asyncio.create_task(_housekeeping(job_service, settings))
        try:
            yield
        finally:
            retention.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retention
            deliverer.stop()
            executor.stop()
            store.dispose()

    app = FastAPI(
        title="modelprep",
        version="1.0.0",
        summary="Prepares very large model checkpoints for deployment with bounded memory.",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served offline by routes/docs.py
        redoc_url=None,  # served offline by routes/docs.py
    )
    app.state.settings = settings
    app.state.jobs = job_service
    app.state.watch = JobWatch(store)
    app.state.keyring = Keyring.from_settings(settings)
    app.state.metrics_registry = service_registry(store, settings)
    app.add_middleware(
        RequestTelemetry, latency=request_latency_histogram(app.state.metrics_registry)
    )
    install_error_handlers(app)
    # Every /v1 router needs a key (a route that forgets its PrincipalDep is still guarded).
    for module in (jobs, artifacts, events, offload):
        app.include_router(module.router, dependencies=[KEY_REQUIRED])
    # Open: probes; /metrics has its own guard; /ui is static files that call /v1 with a key.
    for module in (health, metrics, ui, docs):
        app.include_router(module.router)
    return app
