"""procrastinate's SQL queries that the distributed executor runs in the job store's transaction.

procrastinate has no public synchronous API to list a lock's jobs or to retry one on a given
connection, so :class:`service.jobs.executors.distributed.JobQueue` runs two of its named
queries itself. Assumptions (checked by tests/unit/shims/test_procrastinate.py;
procrastinate capped in pyproject.toml):

* ``procrastinate.sql.queries`` holds ``list_jobs`` and ``retry_job`` with exactly the
  ``%(name)s`` parameters passed below;
* ``SyncPsycopgConnector.execute_query_all_with_connection(connection, query, **params)``
  runs a query on a psycopg connection the caller owns.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from procrastinate import sql
from procrastinate.sync_psycopg_connector import SyncPsycopgConnector

LIST_JOBS_PARAMS = frozenset(
    {"id", "queue_name", "task_name", "status", "lock", "queueing_lock", "worker_id"}
)
RETRY_JOB_PARAMS = frozenset({"job_id", "retry_at", "new_priority", "new_queue_name", "new_lock"})


def list_jobs(
    connector: SyncPsycopgConnector, connection: Any, *, task_name: str, lock: str
) -> list[dict[str, Any]]:
    """procrastinate's jobs of ``task_name`` holding ``lock``, whatever their status."""
    rows: list[dict[str, Any]] = connector.execute_query_all_with_connection(
        connection,
        query=sql.queries["list_jobs"],
        id=None,
        queue_name=None,
        task_name=task_name,
        status=None,
        lock=lock,
        queueing_lock=None,
        worker_id=None,
    )
    return rows


def retry_job(
    connector: SyncPsycopgConnector, connection: Any, job_id: int, retry_at: datetime
) -> None:
    """Put procrastinate job ``job_id`` from ``doing`` back to ``todo``, due at ``retry_at``."""
    connector.execute_query_all_with_connection(
        connection,
        query=sql.queries["retry_job"],
        job_id=job_id,
        retry_at=retry_at,
        new_priority=None,
        new_queue_name=None,
        new_lock=None,
    )
