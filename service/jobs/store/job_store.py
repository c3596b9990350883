""":class:`JobStore`, the façade callers use: it owns the engine, opens connections and
transactions, and hands them to the SQL of each part of the store (see the package docstring).

A method given ``conn`` runs in the caller's transaction (an executor adds its queue's writes
to it); otherwise it opens its own."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection

from service.jobs.model import (
    Artifact,
    CallbackState,
    Job,
    JobError,
    JobStatus,
    Phase,
    PhaseTiming,
    Progress,
)
from service.jobs.store import callbacks, lifecycle, reads, schema, totals
from service.jobs.store import reuse as reuse_sql
from service.jobs.store.admission import Admission
from service.jobs.store.reuse import ReuseDecision
from service.jobs.totals import TotalKey


class JobStore:
    """Jobs persisted in one table; see :mod:`service.jobs.store.lifecycle` for the
    concurrency rules."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_url(cls, url: str) -> JobStore:
        return cls(schema.make_engine(url))

    def create_schema(self) -> None:
        """Bring the database to the newest schema by running the alembic migrations.

        Every process that opens the store at start-up (API, worker) calls this; concurrent
        callers are serialized (see :func:`service.jobs.store.migrations.upgrade`)."""
        from service.jobs.store.migrations import upgrade

        upgrade(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        """One round trip to the database (readiness); raises whatever the driver raises."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    @property
    def reads_never_wait(self) -> bool:
        """Whether a point read is a local file read that waits for no lock and no network:
        SQLite in WAL mode (readers never wait for writers). The API then reads on its event
        loop, where a thread hop would cost more than the read; a network database's reads
        may stall and stay off the loop."""
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One database transaction; an executor adds its own writes (its queue's) to it."""
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _within(self, conn: Connection | None) -> Iterator[Connection]:
        """The caller's transaction if given, else a new one."""
        if conn is not None:
            yield conn
        else:
            with self.engine.begin() as own:
                yield own

    @contextmanager
    def _reading(self, conn: Connection | None = None) -> Iterator[Connection]:
        """The caller's connection if given, else a new one (no transaction of its own)."""
        if conn is not None:
            yield conn
        else:
            with self.engine.connect() as own:
                yield own

    @contextmanager
    def _snapshot(self) -> Iterator[Connection]:
        """A connection whose reads all see one state of the database (a job that ends
        between two of them is counted once, not twice or never).

        PostgreSQL: a REPEATABLE READ transaction. SQLite: an explicit deferred BEGIN (the
        driver would otherwise run each SELECT in a transaction of its own); in WAL mode it
        waits for no writer."""
        if self.engine.dialect.name == "postgresql":
            with (
                self.engine.connect().execution_options(isolation_level="REPEATABLE READ")
                as conn,
                conn.begin(),
            ):
                yield conn
        else:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("BEGIN")
                try:
                    yield conn
                finally:
                    conn.rollback()

    # --- reads (store/reads.py) ---------------------------------------------------------------

    def get(self, job_id: str, tenant: str | None = None, conn: Connection | None = None) -> Job:
        """The job, or JobNotFound (also when it belongs to another tenant)."""
        with self._reading(conn) as c:
            return reads.get(c, job_id, tenant)

    def changed(self, known: Mapping[str, int]) -> dict[str, Job | None]:
        """The jobs of ``known`` (id -> version) that changed, as they are now."""
        with self._reading() as conn:
            return reads.changed(conn, known)

    def page(
        self,
        status: JobStatus | None = None,
        tenant: str | None = None,
        limit: int = 50,
        before: tuple[datetime, str] | None = None,
    ) -> list[Job]:
        """Newest first; ``before`` is the (created_at, id) of the last job of the previous page."""
        with self._reading() as conn:
            return reads.page(conn, status, tenant, limit, before)

    def count(self, status: JobStatus, tenant: str | None = None) -> int:
        with self._reading() as conn:
            return reads.count(conn, [status], tenant)

    def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        """Those of ``job_ids`` flagged for cancellation."""
        with self._reading() as conn:
            return reads.cancel_requested(conn, job_ids)

    def ids_with_status(self, statuses: Sequence[JobStatus]) -> list[str]:
        with self._reading() as conn:
            return reads.ids_with_status(conn, statuses)

    def next_queued(self, limit: int) -> list[str]:
        """Oldest queued job ids first (FIFO)."""
        with self._reading() as conn:
            return reads.next_queued(conn, limit)

    def expired(self, finished_before: datetime, limit: int) -> list[str]:
        """Ids of finished jobs that still hold files and ended before ``finished_before``."""
        with self._reading() as conn:
            return reads.expired(conn, finished_before, limit)

    def stale_running(self, stale_before: datetime) -> list[str]:
        """Running jobs whose last heartbeat is older than ``stale_before``: their worker died."""
        with self._reading() as conn:
            return reads.stale_running(conn, stale_before)

    # --- totals (store/totals.py) -------------------------------------------------------------

    def statistics(self) -> tuple[dict[tuple[str, str], int], dict[TotalKey, float]]:
        """(jobs by (status, phase), totals) for ``/metrics``, read in one snapshot."""
        with self._snapshot() as conn:
            return totals.statistics(conn)

    def artifact_bytes(self, tenant: str | None = None) -> int:
        """Bytes of the artifacts of succeeded jobs whose files are still there."""
        with self._reading() as conn:
            return totals.artifact_bytes(conn, tenant)

    # --- the lifecycle (store/lifecycle.py, admission in store/admission.py) ------------------

    def create(self, job: Job, limits: Admission | None = None) -> Job:
        """Insert a queued job; QueueFull / TenantLimitExceeded when a limit is reached."""
        with self.transaction() as conn:
            lifecycle.insert(conn, job, limits)
        return job

    def insert_in(self, conn: Connection, job: Job, limits: Admission | None = None) -> None:
        """Insert within a caller's transaction, limits checked in it
        (:func:`service.jobs.store.lifecycle.insert`)."""
        lifecycle.insert(conn, job, limits)

    def claim(self, job_id: str, worker: str) -> Job | None:
        """Move a queued job to running for ``worker``; None if someone else got it first."""
        with self.transaction() as conn:
            claimed = lifecycle.claim(conn, job_id, worker)
        return self.get(job_id) if claimed else None

    def report(
        self,
        job_id: str,
        *,
        phase: Phase | None = None,
        progress: Progress | None = None,
        metrics: dict[str, Any] | None = None,
        details: dict[str, Any] | None = None,
        phases: Sequence[PhaseTiming] | None = None,
    ) -> bool:
        """Record progress of a running job; False once it is no longer running (cancelled)."""
        with self.transaction() as conn:
            return lifecycle.report(
                conn, job_id, phase=phase, progress=progress, metrics=metrics, details=details,
                phases=phases,
            )

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        error: JobError | None = None,
        artifacts: Sequence[Artifact] | None = None,
        metrics: dict[str, Any] | None = None,
        details: dict[str, Any] | None = None,
        phases: Sequence[PhaseTiming] | None = None,
        progress: Progress | None = None,
        from_statuses: Sequence[JobStatus] = (JobStatus.RUNNING,),
        conn: Connection | None = None,
        tenant_max_artifact_bytes: int | None = None,
    ) -> bool:
        """Move a job to a terminal status; False if it was not in ``from_statuses``
        (:func:`service.jobs.store.lifecycle.finish`)."""
        with self._within(conn) as tx:
            return lifecycle.finish(
                tx, job_id, status, error=error, artifacts=artifacts, metrics=metrics,
                details=details, phases=phases, progress=progress, from_statuses=from_statuses,
                tenant_max_artifact_bytes=tenant_max_artifact_bytes,
            )

    def request_cancel(
        self, job_id: str, tenant: str | None = None, conn: Connection | None = None
    ) -> Job:
        """Cancel a queued job at once; flag a running one for its executor to stop."""
        with self._within(conn) as tx:
            return lifecycle.request_cancel(tx, job_id, tenant)

    def heartbeat(self, job_ids: Sequence[str], worker: str) -> list[str]:
        """Mark ``worker``'s running jobs alive; returns those still running for it."""
        with self.transaction() as conn:
            return lifecycle.heartbeat(conn, job_ids, worker)

    def lock_stale(self, conn: Connection, job_id: str, stale_before: datetime) -> Job | None:
        """The job if still running with a stale heartbeat, row-locked in ``conn``."""
        return lifecycle.lock_stale(conn, job_id, stale_before)

    def requeue(self, job_id: str, conn: Connection | None = None) -> bool:
        """Put an interrupted running job back in the queue, progress reset."""
        with self._within(conn) as tx:
            return lifecycle.requeue(tx, job_id)

    def mark_deleted(
        self, job_id: str, freed_bytes: int, tenant: str | None = None
    ) -> Job | None:
        """Record that a finished job's files are removed (None: the job is not finished)."""
        with self.transaction() as conn:
            return lifecycle.mark_deleted(conn, job_id, freed_bytes, tenant)

    # --- result reuse (store/reuse.py) --------------------------------------------------------

    def settle_reuse(
        self, job_id: str, key: str, *, reuse: bool = True, exclude: Collection[str] = ()
    ) -> ReuseDecision:
        """Reuse, wait or compute, decided in one transaction
        (:func:`service.jobs.store.reuse.settle_reuse`)."""
        with self.transaction() as conn:
            return reuse_sql.settle_reuse(conn, job_id, key, reuse=reuse, exclude=exclude)

    # --- completion callbacks (store/callbacks.py) --------------------------------------------

    def due_callbacks(self, now: datetime, limit: int) -> list[str]:
        """Ids of jobs whose callback attempt is due at ``now``, most overdue first."""
        with self._reading() as conn:
            return callbacks.due_callbacks(conn, now, limit)

    def next_callback_at(self) -> datetime | None:
        """When the earliest pending callback attempt is due (None: none is pending)."""
        with self._reading() as conn:
            return callbacks.next_callback_at(conn)

    def claim_callback(self, job_id: str, now: datetime, lease_until: datetime) -> Job | None:
        """Take the due callback attempt of ``job_id`` until ``lease_until``; None if another
        deliverer took it first (or it is no longer due)."""
        with self.transaction() as conn:
            if not callbacks.claim_callback(conn, job_id, now, lease_until):
                return None
            return reads.get(conn, job_id)

    def record_callback(
        self,
        job_id: str,
        attempt: int,
        state: CallbackState,
        *,
        status_code: int | None,
        error: str | None,
        next_at: datetime | None = None,
    ) -> bool:
        """Record how attempt number ``attempt`` went; False when it is no longer the job's
        latest."""
        with self.transaction() as conn:
            return callbacks.record_callback(
                conn, job_id, attempt, state, status_code=status_code, error=error,
                next_at=next_at,
            )

    def callback_backlog(self, now: datetime) -> tuple[int, float]:
        """(callbacks pending, seconds the most overdue attempt has been due)."""
        with self._reading() as conn:
            return callbacks.callback_backlog(conn, now)
