"""Admission and tenant limits: the SQL that decides whether a job may be queued, and whether
a succeeded job's artifacts fit in its tenant's artifact-bytes limit.

Both run inside the transaction that writes the job, under the submit lock
(:func:`lock_submits`), so concurrent submits, and jobs ending at once, are serialized and a
limit is never overshot."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from service.errors import QueueFull, TenantLimitExceeded
from service.jobs import totals
from service.jobs.model import Job, JobStatus
from service.jobs.store.reads import count
from service.jobs.store.schema import jobs_table, lock_writes
from service.jobs.store.totals import artifact_bytes, live_artifact_bytes

SUBMIT_LOCK_KEY = 0x6D6F64656C737562
"""The lock key ("modelsub") of submits checking limits: they run one at a time."""


def lock_submits(conn: Connection) -> None:
    """Take the submit lock until ``conn``'s transaction ends."""
    lock_writes(conn, SUBMIT_LOCK_KEY)


def held_bytes(conn: Connection, tenant: str) -> int:
    """The artifact bytes ``tenant`` holds: those of its succeeded jobs whose files are still
    there (``job_totals``) plus the reservations of its queued and running jobs.

    One statement, so one snapshot: a job that ends meanwhile (its reservation gone, its
    artifacts counted, in one transaction) is seen on one side, never on neither."""
    reserved = (
        select(func.coalesce(func.sum(jobs_table.c.reserved_bytes), 0))
        .where(
            jobs_table.c.tenant == tenant,
            jobs_table.c.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
        )
        .scalar_subquery()
    )
    live_bytes, reserved_bytes = conn.execute(
        select(live_artifact_bytes(tenant).scalar_subquery(), reserved)
    ).one()
    return round(float(live_bytes)) + int(reserved_bytes)


@dataclass(frozen=True)
class Admission:
    """The limits a submit is checked against, inside its insert's transaction.

    ``tenant_max_artifact_bytes``: a job is admitted when what its tenant holds (live
    artifact bytes plus the reservations of its queued and running jobs, see
    :func:`held_bytes`) is below the limit and stays within it with the new job's own
    reservation. A job's reservation is an estimate (``JobService`` reserves the source's size
    per export where it can see the source at submission, else nothing); what the job really
    writes is checked again when it ends (:func:`check_artifact_room`), so the live bytes of a
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
            waiting = count(conn, [JobStatus.QUEUED])
            if waiting >= self.max_queued:
                raise QueueFull(f"{waiting} jobs are already queued; retry later")
        if tenant is None:
            return  # open mode: no tenants, no tenant limits
        if self.tenant_max_queued is not None:
            queued = count(conn, [JobStatus.QUEUED], tenant)
            if queued >= self.tenant_max_queued:
                raise TenantLimitExceeded(
                    f"tenant {tenant} has {queued} queued jobs (limit "
                    f"{self.tenant_max_queued}); retry when one has started",
                    retry_after=10,
                )
        if self.tenant_max_active is not None:
            active = count(conn, [JobStatus.QUEUED, JobStatus.RUNNING], tenant)
            if active >= self.tenant_max_active:
                raise TenantLimitExceeded(
                    f"tenant {tenant} has {active} queued or running jobs (limit "
                    f"{self.tenant_max_active}); retry when one has finished",
                    retry_after=30,
                )
        limit = self.tenant_max_artifact_bytes
        if limit is not None:
            held = held_bytes(conn, tenant)
            if held >= limit or held + reserving > limit:
                raise TenantLimitExceeded(
                    f"tenant {tenant} holds {held} artifact bytes (live and reserved by queued "
                    f"or running jobs; limit {limit}) and this job reserves {reserving}; "
                    "delete finished jobs or wait for running ones",
                    retry_after=3600,
                )


def admit(conn: Connection, tenant: str | None, reserving: int, limits: Admission | None) -> None:
    """Check ``limits`` for one more job of ``tenant`` under the submit lock (nothing to do
    without limits); on a refusal the caller's transaction rolls back whatever it wrote."""
    if limits is not None and limits.any():
        lock_submits(conn)
        limits.check(conn, tenant, reserving)


def check_artifact_room(conn: Connection, job: Job, limit: int) -> None:
    """TenantLimitExceeded when the artifacts of ``job`` (ended, in this transaction) do not
    fit in its tenant's limit beside the tenant's live ones."""
    if job.tenant is None:
        return  # open mode: no tenant limits
    if conn.dialect.name == "postgresql":  # SQLite: the UPDATE before took the write lock
        lock_submits(conn)
    used, size = artifact_bytes(conn, job.tenant), totals.artifact_bytes(job)
    if used + size > limit:
        raise TenantLimitExceeded(
            f"the artifacts of job {job.id} ({size} bytes) do not fit in tenant "
            f"{job.tenant}'s limit ({limit} artifact bytes, {used} kept); delete "
            "finished jobs and submit it again",
            retry_after=3600,
        )
