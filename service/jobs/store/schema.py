"""The store's tables and the mapping between a ``jobs`` row and a :class:`Job`.

``version`` grows by one with every change of a row, so a watcher (the events stream) knows
whether it has seen the latest state; a worker's timer heartbeat (``heartbeat_at`` alone, not
part of the job JSON) is the one write that leaves it.

The schema is created and upgraded by the alembic migrations in ``service/jobs/store/migrations/``
(see :meth:`JobStore.create_schema`); the tables below are the definition they must match.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
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
    bindparam,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.engine import Connection, RowMapping

from service.jobs.model import (
    Artifact,
    CallbackDelivery,
    CallbackState,
    Job,
    JobError,
    JobStatus,
    Phase,
    PhaseTiming,
    Progress,
)

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
    Column("phases", JSON, nullable=False, default=list, server_default="[]"),
    Column("attempts", Integer, nullable=False, default=0),
    Column("cancel_requested", Boolean, nullable=False, default=False),
    Column("worker", String(128), nullable=True),
    Column("heartbeat_at", DateTime(timezone=True), nullable=True),
    Column("version", BigInteger, nullable=False, default=0),
    Column("files_deleted_at", DateTime(timezone=True), nullable=True),
    # the completion callback's delivery (store/callbacks.py); the URL is in ``spec``
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

BY_ID = select(jobs_table).where(jobs_table.c.id == bindparam("job_id"))
BY_ID_OF_TENANT = BY_ID.where(jobs_table.c.tenant == bindparam("tenant"))
"""The point reads, built once: building a select (and its cache key) per call cost as much as
running it, and status polls are the API's most frequent request (bench/api_latency.py)."""

NEXT_VERSION = jobs_table.c.version + 1
"""The ``version`` of every write a watcher must see (all but the worker's heartbeat)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def aware(value: datetime | None) -> datetime | None:
    """``value`` in UTC, aware: SQLite returns naive datetimes (stored in UTC), PostgreSQL
    aware ones in the session's time zone; every datetime the store hands out is UTC."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def lock_writes(conn: Connection, key: int) -> None:
    """Serialize the transactions that take the lock ``key`` until ``conn``'s ends.

    PostgreSQL: a transaction-scoped advisory lock on ``key`` (a signed bigint), so unrelated
    keys do not wait for each other. SQLite: the database's write lock, taken by a write that
    changes nothing (SQLite has one writer at a time, whatever the key)."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(key)))
    else:
        conn.execute(update(jobs_table).where(jobs_table.c.id.is_(None)).values(id=None))


def _to_callback(row: RowMapping) -> CallbackDelivery | None:
    spec = row["spec"] or {}
    if row["callback_state"] is None or not isinstance(spec.get("callback"), dict):
        return None
    return CallbackDelivery(
        url=str(spec["callback"].get("url", "")),
        state=CallbackState(row["callback_state"]),
        attempts=row["callback_attempts"] or 0,
        next_attempt_at=aware(row["callback_next_at"]),
        last_status_code=row["callback_last_code"],
        last_error=row["callback_last_error"],
        delivered_at=aware(row["callback_delivered_at"]),
    )


def to_job(row: RowMapping) -> Job:
    """The job a ``jobs`` row holds."""
    error = (
        JobError(type=row["error_type"], message=row["error_message"] or "")
        if row["error_type"]
        else None
    )
    created = aware(row["created_at"])
    assert created is not None
    return Job(
        id=row["id"],
        status=JobStatus(row["status"]),
        phase=Phase(row["phase"]),
        spec=row["spec"],
        tenant=row["tenant"],
        created_at=created,
        started_at=aware(row["started_at"]),
        finished_at=aware(row["finished_at"]),
        progress=Progress(
            done=row["progress_done"], total=row["progress_total"], unit=row["progress_unit"]
        ),
        error=error,
        artifacts=tuple(Artifact(**a) for a in row["artifacts"] or []),
        metrics=dict(row["metrics"] or {}),
        details=dict(row["details"] or {}),
        phases=tuple(PhaseTiming.from_json(entry) for entry in row["phases"] or []),
        attempts=row["attempts"],
        cancel_requested=row["cancel_requested"],
        worker=row["worker"],
        version=row["version"],
        callback=_to_callback(row),
        reserved_bytes=row["reserved_bytes"],
        reused_from=row["reused_from"],
        deleted_at=aware(row["files_deleted_at"]),
    )


def phases_json(phases: Sequence[PhaseTiming]) -> list[dict[str, Any]]:
    """The ``phases`` column's value: the timeline as the job JSON shows it."""
    return [entry.to_json() for entry in phases]


def to_row(job: Job) -> dict[str, Any]:
    """The ``jobs`` row a new job is inserted as."""
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
        "phases": phases_json(job.phases),
        "files_deleted_at": job.deleted_at,
        "attempts": job.attempts,
        "cancel_requested": job.cancel_requested,
        "version": job.version,
        "callback_state": job.callback.state.value if job.callback else None,
        "callback_attempts": job.callback.attempts if job.callback else 0,
        "reserved_bytes": job.reserved_bytes,
    }


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
