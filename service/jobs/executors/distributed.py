"""The distributed executor: jobs queued in PostgreSQL through procrastinate and run by
``modelprep worker`` processes on any host that shares the database and the data directory.

One procrastinate job per modelprep job, carrying only the job id. Its ``lock`` and
``queueing_lock`` are the job id too, so procrastinate itself never runs one job twice at a
time nor queues it twice. Every write to procrastinate's tables goes through :class:`JobQueue`
on the SQLAlchemy connection of the job store's transaction (procrastinate's psycopg connector
accepts an external connection), so the job row and its queue entry change together or not at
all: a job is never queued without a row, nor a row left without a way to run.

This module is the API's half (submit, cancel); ``service/jobs/worker.py`` is the worker's.
"""

from __future__ import annotations

import logging
from typing import Any

import procrastinate
from procrastinate.sync_psycopg_connector import SyncPsycopgConnector
from sqlalchemy import make_url
from sqlalchemy.engine import Connection

from service.config import Settings
from service.errors import ConfigurationError, SecretNotForwardable
from service.jobs.executors.base import admission
from service.jobs.model import Job, JobStatus
from service.jobs.store import JobStore, utcnow
from service.shims.procrastinate import list_jobs, retry_job

log = logging.getLogger(__name__)

TASK_NAME = "modelprep.run_job"
"""The procrastinate task every modelprep job is queued as; its one argument is ``job_id``."""


def libpq_url(sqlalchemy_url: str) -> str:
    """The job store's SQLAlchemy URL as a libpq conninfo URL for procrastinate's pools."""
    url = make_url(sqlalchemy_url)
    if url.get_backend_name() != "postgresql":
        raise ConfigurationError(
            "MODELPREP_EXECUTOR=procrastinate needs a PostgreSQL MODELPREP_DATABASE_URL "
            f"(postgresql+psycopg://...), not {url.get_backend_name()}"
        )
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _driver(conn: Connection) -> Any:
    """The psycopg connection under a SQLAlchemy connection: same session, same transaction."""
    return conn.connection.driver_connection


class JobQueue:
    """procrastinate's side of modelprep jobs, written in the caller's transaction."""

    _LIVE = (procrastinate.jobs.Status.TODO.value, procrastinate.jobs.Status.DOING.value)

    def __init__(self) -> None:
        # Never opened: every call passes the store's connection, so no pool of its own.
        self._connector = SyncPsycopgConnector()
        self._app = procrastinate.App(connector=self._connector)

    def enqueue(self, conn: Connection, job_id: str) -> int:
        """Queue a procrastinate job that runs ``job_id``; returns its procrastinate id."""
        deferrer = self._app.configure_task(
            TASK_NAME, lock=job_id, queueing_lock=job_id, connection=_driver(conn)
        )
        return deferrer.defer(job_id=job_id)

    def entries(self, conn: Connection, job_id: str) -> list[dict[str, Any]]:
        """The procrastinate jobs (id, status, ...) of ``job_id`` still waiting or running."""
        rows = list_jobs(self._connector, _driver(conn), task_name=TASK_NAME, lock=job_id)
        return [row for row in rows if row["status"] in self._LIVE]

    def abort(self, conn: Connection, job_id: str) -> None:
        """Ask procrastinate to abort the job: a waiting one is cancelled, a running one's
        worker is told at once (NOTIFY on commit; it also polls)."""
        for entry in self.entries(conn, job_id):
            self._app.job_manager.cancel_job_by_id(entry["id"], abort=True, connection=_driver(conn))

    def redeliver(self, conn: Connection, job_id: str) -> None:
        """Make the queue deliver ``job_id`` again: a procrastinate job stuck in ``doing`` (its
        worker died) goes back to ``todo``; with none waiting, a new one is queued."""
        entries = self.entries(conn, job_id)
        for entry in entries:
            if entry["status"] == procrastinate.jobs.Status.DOING.value:
                self.retry(conn, entry["id"])
        if not entries:
            self.enqueue(conn, job_id)

    def retry(self, conn: Connection, queue_job_id: int) -> None:
        """Put one procrastinate job from ``doing`` back to ``todo``, due now."""
        retry_job(self._connector, _driver(conn), queue_job_id, utcnow())


class ProcrastinateExecutor:
    """The API's executor when ``MODELPREP_EXECUTOR=procrastinate``: it queues and cancels;
    workers run. The API owns no job process, so restarting it interrupts no job (and it does
    no start-up recovery: a job whose worker died is the surviving workers' business)."""

    def __init__(self, settings: Settings, store: JobStore) -> None:
        libpq_url(settings.sqlalchemy_url)  # refuse a non-PostgreSQL store at once
        self.settings = settings
        self.store = store
        self.queue = JobQueue()

    def start(self) -> None:
        log.info("jobs are queued for modelprep workers (procrastinate)")

    def stop(self) -> None:
        return None

    def submit(self, job: Job, secrets: dict[str, str]) -> Job:
        if secrets:
            raise SecretNotForwardable(
                "a per-job hf_token cannot be handed to a remote worker without storing it; "
                "configure MODELPREP_HF_TOKEN on the workers instead"
            )
        with self.store.transaction() as conn:
            self.store.insert_in(conn, job, admission(self.settings))
            self.queue.enqueue(conn, job.id)
        return job

    def cancel(self, job_id: str, tenant: str | None = None) -> Job:
        with self.store.transaction() as conn:
            job = self.store.request_cancel(job_id, tenant, conn=conn)
            if job.status in (JobStatus.CANCELLED, JobStatus.RUNNING):
                self.queue.abort(conn, job_id)
        return job
