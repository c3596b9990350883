"""The job store: SQLAlchemy Core over SQLite (default) or PostgreSQL, one table.

``version`` grows by one with every change of a row, so a watcher (the events stream) knows
whether it has seen the latest state; a worker's timer heartbeat (``heartbeat_at`` alone, not
part of the job JSON) is the one write that leaves it.

The schema is created and upgraded by the alembic migrations in ``migrations/`` (see
:meth:`JobStore.create_schema`); ``jobs_table`` below is the definition they must match.

Every state change is a single UPDATE guarded by the expected current status, so the API
process, the local pool and job child processes (each with its own engine) can write
concurrently without lost updates: claiming a job, finishing it and cancelling it race
safely. Secrets are never written here.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    create_engine,
    event,
    func,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, RowMapping

from service.errors import Conflict, JobNotFound, QueueFull, TenantLimitExceeded
from service.jobs import totals
from service.jobs.model import (
    Artifact,
    CallbackDelivery,
    CallbackState,
    Job,
    JobError,
    JobStatus,
    Phase,
    Progress,
)
from service.jobs.totals import TotalKey

metadata = MetaData()

jobs_table = Table(
    "jobs",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("status", String(16), nullable=False, index=True),
    Column("phase", String(16), nullable=False),
    Column("spec", JSON, nullable=False),
    Column("tenant", String(64), nullable=True, index=True),
    Column("created_at", DateTime(timezone=True), nullable=False, index=True),
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("finished_at", DateTime(timezone=True), nullable=True, index=True),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("progress_done", BigInteger, nullable=False, default=0),
    Column("progress_total", BigInteger, nullable=True),
    Column("progress_unit", String(16), nullable=False, default="bytes"),
    Column("error_type", String(64), nullable=True),
    Column("error_message", Text, nullable=True),
    Column("artifacts", JSON, nullable=False, default=list),
    Column("metrics", JSON, nullable=False, default=dict),
    Column("details", JSON, nullable=False, default=dict),
    Column("attempts", Integer, nullable=False, default=0),
    Column("cancel_requested", Boolean, nullable=False, default=False),
    Column("worker", String(128), nullable=True),
    Column("heartbeat_at", DateTime(timezone=True), nullable=True),
    Column("version", BigInteger, nullable=False, default=0),
    Column("files_deleted_at", DateTime(timezone=True), nullable=True),
    # the completion callback's delivery (service/jobs/callbacks.py); the URL is in ``spec``
    Column("callback_state", String(16), nullable=True),
    Column("callback_attempts", Integer, nullable=False, default=0, server_default="0"),
    Column("callback_next_at", DateTime(timezone=True), nullable=True, index=True),
    Column("callback_last_code", Integer, nullable=True),
    Column("callback_last_error", Text, nullable=True),
    Column("callback_delivered_at", DateTime(timezone=True), nullable=True),
    Column("reserved_bytes", BigInteger, nullable=False, default=0, server_default="0"),
    Column("reuse_key", String(64), nullable=True, index=True),
    Column("reused_from", String(36), nullable=True),
)

Index("ix_jobs_status_phase", jobs_table.c.status, jobs_table.c.phase)  # /metrics' GROUP BY
Index("ix_jobs_tenant_status", jobs_table.c.tenant, jobs_table.c.status)  # a tenant's reservations

job_totals = Table(
    "job_totals",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("label", String(64), primary_key=True),
    Column("bucket", String(16), primary_key=True),
    Column("value", Float(precision=53), nullable=False),
)
"""What ended jobs add up to (metrics, tenants' artifact bytes): see :mod:`service.jobs.totals`."""


_SUBMIT_LOCK_KEY = 0x6D6F64656C737562
"""pg_advisory_xact_lock key ("modelsub"): submits checking limits run one at a time."""


def _count(conn: Connection, statuses: Sequence[JobStatus], tenant: str | None) -> int:
    query = select(func.count()).select_from(jobs_table).where(
        jobs_table.c.status.in_([s.value for s in statuses])
    )
    if tenant is not None:
        query = query.where(jobs_table.c.tenant == tenant)
    return int(conn.execute(query).scalar_one())


def _held_bytes(conn: Connection, tenant: str) -> int:
    """The artifact bytes ``tenant`` holds: those of its succeeded jobs whose files are still
    there (``job_totals``) plus the reservations of its queued and running jobs.

    One statement, so one snapshot: a job that ends meanwhile (its reservation gone, its
    artifacts counted, in one transaction) is seen on one side, never on neither."""
    live = (
        select(func.coalesce(func.sum(job_totals.c.value), 0.0))
        .where(job_totals.c.name == totals.ARTIFACT_BYTES, job_totals.c.label == tenant)
        .scalar_subquery()
    )
    reserved = (
        select(func.coalesce(func.sum(jobs_table.c.reserved_bytes), 0))
        .where(
            jobs_table.c.tenant == tenant,
            jobs_table.c.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
        )
        .scalar_subquery()
    )
    live_bytes, reserved_bytes = conn.execute(select(live, reserved)).one()
    return round(float(live_bytes)) + int(reserved_bytes)


@dataclass(frozen=True)
class Admission:
    """The limits a submit is checked against, inside its insert's transaction.

    ``tenant_max_artifact_bytes``: a job is admitted when what its tenant holds (live
    artifact bytes plus the reservations of its queued and running jobs, see
    :func:`_held_bytes`) is below the limit and stays within it with the new job's own
    reservation. A job's reservation is an estimate (``JobService`` reserves the source's size
    per export where it can see the source at submission, else nothing); what the job really
    writes is checked again when it ends (:meth:`JobStore.finish`), so the live bytes of a
    tenant never exceed the limit."""

    max_queued: int | None = None
    tenant_max_queued: int | None = None
    tenant_max_active: int | None = None
    tenant_max_artifact_bytes: int | None = None

    def any(self) -> bool:
        return any(v is not None for v in (
            self.max_queued, self.tenant_max_queued, self.tenant_max_active,
            self.tenant_max_artifact_bytes,
        ))

    def check(self, conn: Connection, tenant: str | None, reserving: int = 0) -> None:
        """QueueFull / TenantLimitExceeded when admitting one more job (that reserves
        ``reserving`` artifact bytes) would break a limit."""
        if self.max_queued is not None:
            waiting = _count(conn, [JobStatus.QUEUED], None)
            if waiting >= self.max_queued:
                raise QueueFull(f"{waiting} jobs are already queued; retry later")
        if tenant is None:
            return  # open mode: no tenants, no tenant limits
        if self.tenant_max_queued is not None:
            queued = _count(conn, [JobStatus.QUEUED], tenant)
            if queued >= self.tenant_max_queued:
                raise TenantLimitExceeded(
                    f"tenant {tenant} has {queued} queued jobs (limit "
                    f"{self.tenant_max_queued}); retry when one has started",
                    retry_after=10,
                )
        if self.tenant_max_active is not None:
            active = _count(conn, [JobStatus.QUEUED, JobStatus.RUNNING], tenant)
            if active >= self.tenant_max_active:
                raise TenantLimitExceeded(
                    f"tenant {tenant} has {active} queued or running jobs (limit "
                    f"{self.tenant_max_active}); retry when one has finished",
                    retry_after=30,
                )
        limit = self.tenant_max_artifact_bytes
        if limit is not None:
            held = _held_bytes(conn, tenant)
            if held >= limit or held + reserving > limit:
                raise TenantLimitExceeded(
                    f"tenant {tenant} holds {held} artifact bytes (live and reserved by queued "
                    f"or running jobs; limit {limit}) and this job reserves {reserving}; "
                    "delete finished jobs or wait for running ones",
                    retry_after=3600,
                )


class ReuseAction(StrEnum):
    REUSE = "reuse"
    """A succeeded job with the same key still holds its artifacts: share them."""
    WAIT = "wait"
    """Another job with the same key is running: wait for its outcome, then settle again."""
    COMPUTE = "compute"
    """Nobody has or is computing the result: this job computes it (and others may wait)."""


@dataclass(frozen=True)
class ReuseDecision:
    action: ReuseAction
    other: Job | None = None
    """The job reused (REUSE) or waited for (WAIT)."""


_BY_ID = select(jobs_table).where(jobs_table.c.id == bindparam("job_id"))
_BY_ID_OF_TENANT = _BY_ID.where(jobs_table.c.tenant == bindparam("tenant"))
"""The point reads, built once: building a select (and its cache key) per call cost as much as
running it, and status polls are the API's most frequent request (bench/api_latency.py)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def _aware(value: datetime | None) -> datetime | None:
    # SQLite returns naive datetimes; every datetime the store hands out is UTC-aware.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def _to_callback(row: RowMapping) -> CallbackDelivery | None:
    spec = row["spec"] or {}
    if row["callback_state"] is None or not isinstance(spec.get("callback"), dict):
        return None
    return CallbackDelivery(
        url=str(spec["callback"].get("url", "")),
        state=CallbackState(row["callback_state"]),
        attempts=row["callback_attempts"] or 0,
        next_attempt_at=_aware(row["callback_next_at"]),
        last_status_code=row["callback_last_code"],
        last_error=row["callback_last_error"],
        delivered_at=_aware(row["callback_delivered_at"]),
    )


def _to_job(row: RowMapping) -> Job:
    error = (
        JobError(type=row["error_type"], message=row["error_message"] or "")
        if row["error_type"]
        else None
    )
    created = _aware(row["created_at"])
    assert created is not None
    return Job(
        id=row["id"],
        status=JobStatus(row["status"]),
        phase=Phase(row["phase"]),
        spec=row["spec"],
        tenant=row["tenant"],
        created_at=created,
        started_at=_aware(row["started_at"]),
        finished_at=_aware(row["finished_at"]),
        progress=Progress(
            done=row["progress_done"], total=row["progress_total"], unit=row["progress_unit"]
        ),
        error=error,
        artifacts=tuple(Artifact(**a) for a in row["artifacts"] or []),
        metrics=dict(row["metrics"] or {}),
        details=dict(row["details"] or {}),
        attempts=row["attempts"],
        cancel_requested=row["cancel_requested"],
        worker=row["worker"],
        version=row["version"],
        callback=_to_callback(row),
        reserved_bytes=row["reserved_bytes"],
        reused_from=row["reused_from"],
    )


def make_engine(url: str) -> Engine:
    """An engine tuned for several processes sharing one database."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"timeout": 30, "check_same_thread": False},
            json_serializer=json.dumps,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


class JobStore:
    """Jobs persisted in one table; see the module docstring for the concurrency rules."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_url(cls, url: str) -> JobStore:
        return cls(make_engine(url))

    def create_schema(self) -> None:
        """Bring the database to the newest schema by running the alembic migrations.

        Every process that opens the store at start-up (API, worker) calls this; concurrent
        callers are serialized (see :func:`service.jobs.migrations.upgrade`)."""
        from service.jobs.migrations import upgrade

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

    # --- reads -------------------------------------------------------------------------------

    def get(self, job_id: str, tenant: str | None = None, conn: Connection | None = None) -> Job:
        """The job, or JobNotFound (also when it belongs to another tenant)."""
        query, params = (
            (_BY_ID, {"job_id": job_id})
            if tenant is None
            else (_BY_ID_OF_TENANT, {"job_id": job_id, "tenant": tenant})
        )
        if conn is not None:
            row = conn.execute(query, params).mappings().first()
        else:
            with self.engine.connect() as own:
                row = own.execute(query, params).mappings().first()
        if row is None:
            raise JobNotFound(f"no job {job_id}")
        return _to_job(row)

    def changed(self, known: Mapping[str, int]) -> dict[str, Job | None]:
        """The jobs of ``known`` (id -> version) whose version is no longer the known one, in
        their current state (None: no such job any more).

        One query for the versions, one more for the rows that moved: a watcher of many jobs
        pays for the changes, not for every job at every poll."""
        if not known:
            return {}
        ids = list(known)
        with self.engine.connect() as conn:
            versions: dict[str, int] = {
                job_id: version
                for job_id, version in conn.execute(
                    select(jobs_table.c.id, jobs_table.c.version).where(jobs_table.c.id.in_(ids))
                )
            }
            moved = [job_id for job_id in ids if versions.get(job_id) != known[job_id]]
            present = [job_id for job_id in moved if job_id in versions]
            rows = (
                conn.execute(select(jobs_table).where(jobs_table.c.id.in_(present))).mappings().all()
                if present
                else []
            )
        found: dict[str, Job | None] = dict.fromkeys(moved)
        found.update((row["id"], _to_job(row)) for row in rows)
        return found

    def page(
        self,
        status: JobStatus | None = None,
        tenant: str | None = None,
        limit: int = 50,
        before: tuple[datetime, str] | None = None,
    ) -> list[Job]:
        """Newest first; ``before`` is the (created_at, id) of the last job of the previous page."""
        query = select(jobs_table).order_by(
            jobs_table.c.created_at.desc(), jobs_table.c.id.desc()
        )
        if status is not None:
            query = query.where(jobs_table.c.status == status.value)
        if tenant is not None:
            query = query.where(jobs_table.c.tenant == tenant)
        if before is not None:
            created, job_id = before
            query = query.where(
                (jobs_table.c.created_at < created)
                | (and_(jobs_table.c.created_at == created, jobs_table.c.id < job_id))
            )
        with self.engine.connect() as conn:
            rows = conn.execute(query.limit(limit)).mappings().all()
        return [_to_job(r) for r in rows]

    def count(self, status: JobStatus, tenant: str | None = None) -> int:
        query = select(func.count()).select_from(jobs_table).where(
            jobs_table.c.status == status.value
        )
        if tenant is not None:
            query = query.where(jobs_table.c.tenant == tenant)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

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

    def statistics(self) -> tuple[dict[tuple[str, str], int], dict[TotalKey, float]]:
        """(jobs by (status, phase), totals) for ``/metrics``, read in one snapshot.

        The totals are those of ended jobs (``job_totals``) plus what running jobs have
        reported so far. Bounded work whatever the number of jobs: a GROUP BY, the totals
        table (a few hundred rows) and the running jobs' rows (as many as the workers run)."""
        with self._snapshot() as conn:
            states = {
                (status, phase): int(count)
                for status, phase, count in conn.execute(
                    select(jobs_table.c.status, jobs_table.c.phase, func.count())
                    .group_by(jobs_table.c.status, jobs_table.c.phase)
                )
            }
            stored = {
                (name, label, bucket): float(value)
                for name, label, bucket, value in conn.execute(select(job_totals))
            }
            running = conn.execute(
                select(jobs_table).where(jobs_table.c.status == JobStatus.RUNNING.value)
            ).mappings().all()
        return states, totals.merged(
            [stored, *(totals.running_figures(_to_job(row)) for row in running)]
        )

    def artifact_bytes(self, tenant: str | None = None) -> int:
        """Bytes of the artifacts of succeeded jobs whose files are still there (of
        ``tenant``, or of everyone); one read of ``job_totals``."""
        query = select(func.coalesce(func.sum(job_totals.c.value), 0.0)).where(
            job_totals.c.name == totals.ARTIFACT_BYTES
        )
        if tenant is not None:
            query = query.where(job_totals.c.label == tenant)
        with self.engine.connect() as conn:
            return round(float(conn.execute(query).scalar_one()))

    def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        """Those of ``job_ids`` flagged for cancellation (one query for all of them)."""
        if not job_ids:
            return set()
        query = select(jobs_table.c.id).where(
            jobs_table.c.id.in_(list(job_ids)), jobs_table.c.cancel_requested.is_(True)
        )
        with self.engine.connect() as conn:
            return {r[0] for r in conn.execute(query)}

    def ids_with_status(self, statuses: Sequence[JobStatus]) -> list[str]:
        query = select(jobs_table.c.id).where(
            jobs_table.c.status.in_([s.value for s in statuses])
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    # --- writes ------------------------------------------------------------------------------

    def create(self, job: Job, limits: Admission | None = None) -> Job:
        """Insert a queued job; QueueFull / TenantLimitExceeded when a limit is reached."""
        with self.transaction() as conn:
            self.insert_in(conn, job, limits)
        return job

    def insert_in(self, conn: Connection, job: Job, limits: Admission | None = None) -> None:
        """Insert within a caller's transaction (a distributed executor enqueues in the same one).

        The limits are checked inside that transaction, after taking the database's submit lock
        (PostgreSQL: a transaction-scoped advisory lock; SQLite: the write lock, taken by a
        write that changes nothing), so concurrent submits are serialized and a limit is never
        overshot. On a refusal the caller's transaction rolls back whatever else it wrote."""
        if limits is not None and limits.any():
            self._lock_submits(conn)
            limits.check(conn, job.tenant, job.reserved_bytes)
        conn.execute(jobs_table.insert().values(**self._row(job)))
        if job.status.terminal:  # inserted ended (an import, a test): its figures count too
            self._add_totals(conn, totals.ended_figures(job))

    @staticmethod
    def _lock_submits(conn: Connection) -> None:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_SUBMIT_LOCK_KEY})")
        else:
            conn.execute(update(jobs_table).where(jobs_table.c.id.is_(None)).values(id=None))

    @staticmethod
    def _add_totals(conn: Connection, figures: Mapping[TotalKey, float]) -> None:
        """Add ``figures`` to ``job_totals`` within the caller's transaction (an upsert per key,
        in key order, so that two transactions adding to the same rows never deadlock)."""
        rows = [
            {"name": name, "label": label, "bucket": bucket, "value": value}
            for (name, label, bucket), value in sorted(figures.items())
            if value
        ]
        if not rows:
            return
        insert = (
            postgresql_insert(job_totals)
            if conn.dialect.name == "postgresql"
            else sqlite_insert(job_totals)
        )
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=[job_totals.c.name, job_totals.c.label, job_totals.c.bucket],
                set_={"value": job_totals.c.value + insert.excluded.value},
            ),
            rows,
        )

    @staticmethod
    def _row(job: Job) -> dict[str, Any]:
        return {
            "id": job.id,
            "status": job.status.value,
            "phase": job.phase.value,
            "spec": job.spec,
            "tenant": job.tenant,
            "created_at": job.created_at,
            "updated_at": job.created_at,
            "progress_done": job.progress.done,
            "progress_total": job.progress.total,
            "progress_unit": job.progress.unit,
            "artifacts": [asdict(a) for a in job.artifacts],
            "metrics": job.metrics,
            "details": job.details,
            "attempts": job.attempts,
            "cancel_requested": job.cancel_requested,
            "version": job.version,
            "callback_state": job.callback.state.value if job.callback else None,
            "callback_attempts": job.callback.attempts if job.callback else 0,
            "reserved_bytes": job.reserved_bytes,
        }

    def claim(self, job_id: str, worker: str) -> Job | None:
        """Move a queued job to running for ``worker``; None if someone else got it first.

        The phase moves on to the first one the pipeline runs (download), so that no job is
        ever seen ``running`` in phase ``queued`` while its process starts."""
        now = utcnow()
        with self.transaction() as conn:
            result = conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id, jobs_table.c.status == JobStatus.QUEUED.value)
                .values(
                    version=jobs_table.c.version + 1,
                    status=JobStatus.RUNNING.value,
                    started_at=now,
                    updated_at=now,
                    heartbeat_at=now,
                    worker=worker,
                    attempts=jobs_table.c.attempts + 1,
                    phase=Phase.DOWNLOAD.value,
                    progress_done=0,
                    progress_total=None,
                    progress_unit="bytes",
                )
            )
        return self.get(job_id) if result.rowcount == 1 else None

    def next_queued(self, limit: int) -> list[str]:
        """Oldest queued job ids first (FIFO)."""
        query = (
            select(jobs_table.c.id)
            .where(jobs_table.c.status == JobStatus.QUEUED.value)
            .order_by(jobs_table.c.created_at, jobs_table.c.id)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    def report(
        self,
        job_id: str,
        *,
        phase: Phase | None = None,
        progress: Progress | None = None,
        metrics: dict[str, Any] | None = None,
        details: dict[str, Any] | None = None,
    ) -> bool:
        """Record progress of a running job; False once it is no longer running (cancelled)."""
        values: dict[str, Any] = {
            "updated_at": utcnow(),
            "heartbeat_at": utcnow(),
            "version": jobs_table.c.version + 1,
        }
        if phase is not None:
            values["phase"] = phase.value
        if progress is not None:
            values.update(
                progress_done=progress.done,
                progress_total=progress.total,
                progress_unit=progress.unit,
            )
        if metrics is not None:
            values["metrics"] = metrics
        if details is not None:
            values["details"] = details
        with self.transaction() as conn:
            result = conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id, jobs_table.c.status == JobStatus.RUNNING.value)
                .values(**values)
            )
        return result.rowcount == 1

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        error: JobError | None = None,
        artifacts: Sequence[Artifact] | None = None,
        metrics: dict[str, Any] | None = None,
        details: dict[str, Any] | None = None,
        progress: Progress | None = None,
        from_statuses: Sequence[JobStatus] = (JobStatus.RUNNING,),
        conn: Connection | None = None,
        tenant_max_artifact_bytes: int | None = None,
    ) -> bool:
        """Move a job to a terminal status; False if it was not in ``from_statuses``.

        ``progress`` is the last phase's final count (a succeeded job ends with every file
        of its finalize phase done, not with whatever the last throttled report said).

        With ``tenant_max_artifact_bytes``, a job of a tenant succeeds only if its artifacts
        fit beside the tenant's live ones; else TenantLimitExceeded and nothing is written
        (the caller fails the job and removes its files). Checked under the submit lock, so
        two jobs ending at once cannot both take the last free bytes."""
        assert status.terminal
        now = utcnow()
        values: dict[str, Any] = {
            "status": status.value,
            "version": jobs_table.c.version + 1,
            "finished_at": now,
            "updated_at": now,
            "error_type": error.type if error else None,
            "error_message": error.message if error else None,
        }
        if status is JobStatus.SUCCEEDED:
            values["phase"] = Phase.DONE.value
        # The job's callback (if any) becomes due in the same write: whichever process ends the
        # job, no terminal status is ever left without its delivery scheduled.
        waiting = jobs_table.c.callback_state == CallbackState.WAITING.value
        values["callback_state"] = case(
            (waiting, CallbackState.PENDING.value), else_=jobs_table.c.callback_state
        )
        values["callback_next_at"] = case((waiting, now), else_=jobs_table.c.callback_next_at)
        if progress is not None:
            values["progress_done"] = progress.done
            values["progress_total"] = progress.total
            values["progress_unit"] = progress.unit
        if artifacts is not None:
            values["artifacts"] = [asdict(a) for a in artifacts]
        if metrics is not None:
            values["metrics"] = metrics
        if details is not None:
            values["details"] = details
        with self._within(conn) as tx:
            result = tx.execute(
                update(jobs_table)
                .where(
                    jobs_table.c.id == job_id,
                    jobs_table.c.status.in_([s.value for s in from_statuses]),
                )
                .values(**values)
            )
            if result.rowcount != 1:
                return False
            ended = self.get(job_id, conn=tx)
            if status is JobStatus.SUCCEEDED and tenant_max_artifact_bytes is not None:
                self._check_artifact_room(tx, ended, tenant_max_artifact_bytes)
            # Its figures join the totals in the same transaction: counted once, never lost.
            self._add_totals(tx, totals.ended_figures(ended))
        return True

    def _check_artifact_room(self, conn: Connection, job: Job, limit: int) -> None:
        """TenantLimitExceeded when ``job``'s artifacts do not fit in its tenant's limit."""
        if job.tenant is None:
            return  # open mode: no tenant limits
        if conn.dialect.name == "postgresql":  # SQLite: the UPDATE before took the write lock
            self._lock_submits(conn)
        live = conn.execute(
            select(func.coalesce(func.sum(job_totals.c.value), 0.0)).where(
                job_totals.c.name == totals.ARTIFACT_BYTES, job_totals.c.label == job.tenant
            )
        ).scalar_one()
        used, size = round(float(live)), totals.artifact_bytes(job)
        if used + size > limit:
            raise TenantLimitExceeded(
                f"the artifacts of job {job.id} ({size} bytes) do not fit in tenant "
                f"{job.tenant}'s limit ({limit} artifact bytes, {used} kept); delete "
                "finished jobs and submit it again",
                retry_after=3600,
            )

    def mark_deleted(
        self, job_id: str, freed_bytes: int, tenant: str | None = None
    ) -> Job | None:
        """Record that a finished job's files are removed: no artifacts any more, and
        ``deleted_at`` / ``artifact_bytes_freed`` in its details and metrics. The row stays as
        a tombstone (its history and metrics). None if the job is not finished; the job as it
        is if already deleted."""
        with self.transaction() as conn:
            job = self.get(job_id, tenant, conn=conn)
            if not job.status.terminal:
                return None
            if "deleted_at" in job.details:
                return job
            now = utcnow()
            marked = conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id, jobs_table.c.files_deleted_at.is_(None))
                .values(
                    artifacts=[],
                    files_deleted_at=now,
                    details={**job.details, "deleted_at": now.isoformat()},
                    metrics={**job.metrics, "artifact_bytes_freed": freed_bytes},
                    updated_at=now,
                    version=jobs_table.c.version + 1,
                )
            )
            if marked.rowcount != 1:  # another removal marked it meanwhile
                return self.get(job_id, conn=conn)
            freed: dict[TotalKey, float] = {(totals.FREED, "", ""): float(freed_bytes)}
            if job.status is JobStatus.SUCCEEDED:
                freed[(totals.ARTIFACT_BYTES, job.tenant or "", "")] = -float(
                    totals.artifact_bytes(job)
                )
            self._add_totals(conn, freed)
            return self.get(job_id, conn=conn)

    def expired(self, finished_before: datetime, limit: int) -> list[str]:
        """Ids of finished jobs that still hold files and ended before ``finished_before``."""
        query = (
            select(jobs_table.c.id)
            .where(
                jobs_table.c.finished_at < finished_before,
                jobs_table.c.files_deleted_at.is_(None),
                jobs_table.c.status.in_([s.value for s in JobStatus if s.terminal]),
            )
            .order_by(jobs_table.c.finished_at)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    def settle_reuse(
        self, job_id: str, key: str, *, reuse: bool = True, exclude: Collection[str] = ()
    ) -> ReuseDecision:
        """Decide, for running job ``job_id`` whose result has key ``key``, whether it reuses a
        succeeded job's artifacts, waits for a running job computing the same result, or
        computes it itself (opting out with ``reuse=False`` always computes).

        The decision and its record (``reuse_key``, and ``reused_from`` when reusing) are one
        transaction under a lock on the key (PostgreSQL: a transaction-scoped advisory lock;
        SQLite: the database's write lock, taken first), so of two identical jobs settling at
        once, on any host, exactly one computes and the other sees it running. Only *running*
        jobs are waited for: one re-queued or stuck in the queue is never waited for by a job
        holding a worker slot, so waiting never deadlocks a full pool. ``exclude``: jobs not
        to reuse (their files turned out to be gone)."""
        with self.transaction() as conn:
            self._lock_key(conn, key)
            if reuse:
                same = and_(
                    jobs_table.c.reuse_key == key,
                    jobs_table.c.id.not_in([job_id, *exclude]),
                )
                row = conn.execute(
                    select(jobs_table)
                    .where(
                        same,
                        jobs_table.c.status == JobStatus.SUCCEEDED.value,
                        jobs_table.c.files_deleted_at.is_(None),
                    )
                    .order_by(jobs_table.c.finished_at.desc(), jobs_table.c.id)
                    .limit(1)
                ).mappings().first()
                if row is not None:
                    self._set_reuse(conn, job_id, key, reused_from=row["id"])
                    return ReuseDecision(ReuseAction.REUSE, _to_job(row))
                row = conn.execute(
                    select(jobs_table)
                    .where(same, jobs_table.c.status == JobStatus.RUNNING.value)
                    .order_by(jobs_table.c.started_at, jobs_table.c.id)
                    .limit(1)
                ).mappings().first()
                if row is not None:
                    return ReuseDecision(ReuseAction.WAIT, _to_job(row))
            self._set_reuse(conn, job_id, key, reused_from=None)
            return ReuseDecision(ReuseAction.COMPUTE)

    @staticmethod
    def _lock_key(conn: Connection, key: str) -> None:
        if conn.dialect.name == "postgresql":
            # 60 bits of the (hex) key: a signed bigint, distinct from the submit lock's key.
            conn.execute(select(func.pg_advisory_xact_lock(int(key[:15], 16))))
        else:
            conn.execute(update(jobs_table).where(jobs_table.c.id.is_(None)).values(id=None))

    @staticmethod
    def _set_reuse(conn: Connection, job_id: str, key: str, reused_from: str | None) -> None:
        conn.execute(
            update(jobs_table)
            .where(jobs_table.c.id == job_id)
            .values(
                reuse_key=key,
                reused_from=reused_from,
                updated_at=utcnow(),
                version=jobs_table.c.version + 1,
            )
        )

    def request_cancel(
        self, job_id: str, tenant: str | None = None, conn: Connection | None = None
    ) -> Job:
        """Cancel a queued job at once; flag a running one for its executor to stop."""
        with self._within(conn) as tx:
            job = self.get(job_id, tenant, conn=tx)
            if job.status.terminal:
                raise Conflict(f"job {job_id} is already {job.status.value}")
            if job.status is JobStatus.QUEUED and self.finish(
                job_id,
                JobStatus.CANCELLED,
                error=JobError("job_cancelled", "cancelled before it started"),
                from_statuses=(JobStatus.QUEUED,),
                conn=tx,
            ):
                return self.get(job_id, conn=tx)
            tx.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .values(
                    cancel_requested=True, updated_at=utcnow(), version=jobs_table.c.version + 1
                )
            )
            return self.get(job_id, conn=tx)

    def heartbeat(self, job_ids: Sequence[str], worker: str) -> list[str]:
        """Mark ``worker``'s running jobs alive; returns those still running for it.

        The worker's timer calls this so that a quiet phase (no progress report) is not taken
        for a dead worker. It is not a change a watcher cares about: ``version`` stays."""
        alive = []
        now = utcnow()
        with self.transaction() as conn:
            for job_id in job_ids:
                result = conn.execute(
                    update(jobs_table)
                    .where(
                        jobs_table.c.id == job_id,
                        jobs_table.c.status == JobStatus.RUNNING.value,
                        jobs_table.c.worker == worker,
                    )
                    .values(heartbeat_at=now)
                )
                if result.rowcount == 1:
                    alive.append(job_id)
        return alive

    def stale_running(self, stale_before: datetime) -> list[str]:
        """Running jobs whose last heartbeat is older than ``stale_before``: their worker died."""
        query = select(jobs_table.c.id).where(
            jobs_table.c.status == JobStatus.RUNNING.value,
            jobs_table.c.heartbeat_at < stale_before,
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    def lock_stale(self, conn: Connection, job_id: str, stale_before: datetime) -> Job | None:
        """The job if it is still running with a stale heartbeat, row-locked (PostgreSQL) until
        the caller's transaction ends, so that one reaper among many releases it."""
        row = conn.execute(
            select(jobs_table)
            .where(
                jobs_table.c.id == job_id,
                jobs_table.c.status == JobStatus.RUNNING.value,
                jobs_table.c.heartbeat_at < stale_before,
            )
            .with_for_update(skip_locked=True)
        ).mappings().first()
        return None if row is None else _to_job(row)

    def requeue(self, job_id: str, conn: Connection | None = None) -> bool:
        """Put an interrupted running job back in the queue, progress reset."""
        with self._within(conn) as tx:
            result = tx.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id, jobs_table.c.status == JobStatus.RUNNING.value)
                .values(
                    version=jobs_table.c.version + 1,
                    status=JobStatus.QUEUED.value,
                    phase=Phase.QUEUED.value,
                    progress_done=0,
                    progress_total=None,
                    worker=None,
                    reused_from=None,  # the next attempt settles reuse anew
                    updated_at=utcnow(),
                )
            )
        return result.rowcount == 1

    # --- completion callbacks (service/jobs/callbacks.py) -------------------------------------

    def due_callbacks(self, now: datetime, limit: int) -> list[str]:
        """Ids of jobs whose callback attempt is due at ``now``, most overdue first (an
        indexed range on ``callback_next_at``, which only pending callbacks have)."""
        query = (
            select(jobs_table.c.id)
            .where(jobs_table.c.callback_next_at <= now)
            .order_by(jobs_table.c.callback_next_at)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    def next_callback_at(self) -> datetime | None:
        """When the earliest pending callback attempt is due (None: none is pending)."""
        with self.engine.connect() as conn:
            value = conn.execute(select(func.min(jobs_table.c.callback_next_at))).scalar_one()
        return _aware(value)

    def claim_callback(self, job_id: str, now: datetime, lease_until: datetime) -> Job | None:
        """Take the due callback attempt of ``job_id`` until ``lease_until``; None if another
        deliverer took it first (or it is no longer due).

        The attempt counts from here: if this deliverer dies mid-POST, the lease runs out and
        another one retries. One UPDATE guarded by the due time, so concurrent deliverers (API
        processes, workers) never send the same attempt twice."""
        with self.transaction() as conn:
            result = conn.execute(
                update(jobs_table)
                .where(
                    jobs_table.c.id == job_id,
                    jobs_table.c.callback_state == CallbackState.PENDING.value,
                    jobs_table.c.callback_next_at <= now,
                )
                .values(
                    callback_next_at=lease_until,
                    callback_attempts=jobs_table.c.callback_attempts + 1,
                    version=jobs_table.c.version + 1,
                    updated_at=now,
                )
            )
            if result.rowcount != 1:
                return None
            return self.get(job_id, conn=conn)

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
        """Record how attempt number ``attempt`` went: ``state`` pending (retry at
        ``next_at``), delivered or failed. False when that attempt is no longer the job's
        latest (its lease ran out and another deliverer took over)."""
        now = utcnow()
        with self.transaction() as conn:
            result = conn.execute(
                update(jobs_table)
                .where(
                    jobs_table.c.id == job_id,
                    jobs_table.c.callback_state == CallbackState.PENDING.value,
                    jobs_table.c.callback_attempts == attempt,
                )
                .values(
                    callback_state=state.value,
                    callback_next_at=next_at if state is CallbackState.PENDING else None,
                    callback_last_code=status_code,
                    callback_last_error=error,
                    callback_delivered_at=now if state is CallbackState.DELIVERED else None,
                    version=jobs_table.c.version + 1,
                    updated_at=now,
                )
            )
            if result.rowcount == 1:
                self._add_totals(conn, totals.callback_figures(state))
        return result.rowcount == 1

    def callback_backlog(self, now: datetime) -> tuple[int, float]:
        """(callbacks pending, seconds the most overdue attempt has been due) for ``/metrics``:
        a count over the index range of pending callbacks, bounded by the backlog."""
        pending = jobs_table.c.callback_next_at.is_not(None)
        with self.engine.connect() as conn:
            count, oldest = conn.execute(
                select(func.count(), func.min(jobs_table.c.callback_next_at)).where(pending)
            ).one()
        due = _aware(oldest)
        return int(count), max(0.0, (now - due).total_seconds()) if due is not None else 0.0
