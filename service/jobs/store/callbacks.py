"""The SQL of completion callbacks (the feature: :mod:`service.jobs.callbacks`): the delivery
state on the job's row (``callback_*`` columns), due attempts, leases and outcomes.

Every write is one UPDATE guarded by the state it expects, so deliverers in several processes
never send the same attempt twice, and a lease that runs out hands the attempt to another."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.engine import Connection

from service.jobs import totals
from service.jobs.model import CallbackState
from service.jobs.store.schema import NEXT_VERSION, aware, jobs_table, utcnow
from service.jobs.store.totals import add_totals


def due_when_ended(now: datetime) -> dict[str, Any]:
    """The values that make a waiting callback due at ``now``, for the write that ends its
    job: whichever process ends the job, no terminal status is ever left without its delivery
    scheduled (a job without a callback, or one already due, keeps its values)."""
    waiting = jobs_table.c.callback_state == CallbackState.WAITING.value
    return {
        "callback_state": case(
            (waiting, CallbackState.PENDING.value), else_=jobs_table.c.callback_state
        ),
        "callback_next_at": case((waiting, now), else_=jobs_table.c.callback_next_at),
    }


def due_callbacks(conn: Connection, now: datetime, limit: int) -> list[str]:
    """Ids of jobs whose callback attempt is due at ``now``, most overdue first (an indexed
    range on ``callback_next_at``, which only pending callbacks have)."""
    query = (
        select(jobs_table.c.id)
        .where(jobs_table.c.callback_next_at <= now)
        .order_by(jobs_table.c.callback_next_at)
        .limit(limit)
    )
    return [r[0] for r in conn.execute(query)]


def next_callback_at(conn: Connection) -> datetime | None:
    """When the earliest pending callback attempt is due (None: none is pending)."""
    return aware(conn.execute(select(func.min(jobs_table.c.callback_next_at))).scalar_one())


def claim_callback(conn: Connection, job_id: str, now: datetime, lease_until: datetime) -> bool:
    """Take the due callback attempt of ``job_id`` until ``lease_until``; False if another
    deliverer took it first (or it is no longer due).

    The attempt counts from here: if this deliverer dies mid-POST, the lease runs out and
    another one retries. One UPDATE guarded by the due time, so concurrent deliverers (API
    processes, workers) never send the same attempt twice."""
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
            version=NEXT_VERSION,
            updated_at=now,
        )
    )
    return result.rowcount == 1


def record_callback(
    conn: Connection,
    job_id: str,
    attempt: int,
    state: CallbackState,
    *,
    status_code: int | None,
    error: str | None,
    next_at: datetime | None = None,
) -> bool:
    """Record how attempt number ``attempt`` went: ``state`` pending (retry at ``next_at``),
    delivered or failed, and add it to the totals. False when that attempt is no longer the
    job's latest (its lease ran out and another deliverer took over)."""
    now = utcnow()
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
            version=NEXT_VERSION,
            updated_at=now,
        )
    )
    if result.rowcount != 1:
        return False
    add_totals(conn, totals.callback_figures(state))
    return True


def callback_backlog(conn: Connection, now: datetime) -> tuple[int, float]:
    """(callbacks pending, seconds the most overdue attempt has been due) for ``/metrics``:
    a count over the index range of pending callbacks, bounded by the backlog."""
    count, oldest = conn.execute(
        select(func.count(), func.min(jobs_table.c.callback_next_at)).where(
            jobs_table.c.callback_next_at.is_not(None)
        )
    ).one()
    due = aware(oldest)
    return int(count), max(0.0, (now - due).total_seconds()) if due is not None else 0.0
