"""The assumptions service.shims.procrastinate makes about procrastinate's queries, named in
the failure message so that an upgrade that breaks one says which (the queries also run against
PostgreSQL in tests/integration/distributed)."""

from __future__ import annotations

import inspect
import re

from procrastinate import sql
from procrastinate.sync_psycopg_connector import SyncPsycopgConnector

from service.shims.procrastinate import LIST_JOBS_PARAMS, RETRY_JOB_PARAMS


def _params(name: str) -> frozenset[str]:
    assert name in sql.queries, f"assumption broken: procrastinate.sql.queries has {name!r}"
    return frozenset(re.findall(r"%\((\w+)\)s", sql.queries[name]))


def test_list_jobs_and_retry_job_take_the_parameters_the_adapter_passes() -> None:
    assert _params("list_jobs") == LIST_JOBS_PARAMS, (
        "assumption broken: procrastinate's list_jobs query takes exactly "
        f"{sorted(LIST_JOBS_PARAMS)}"
    )
    assert _params("retry_job") == RETRY_JOB_PARAMS, (
        "assumption broken: procrastinate's retry_job query takes exactly "
        f"{sorted(RETRY_JOB_PARAMS)}"
    )


def test_the_sync_connector_runs_a_query_on_the_callers_connection() -> None:
    method = getattr(SyncPsycopgConnector, "execute_query_all_with_connection", None)
    assert method is not None, (
        "assumption broken: SyncPsycopgConnector.execute_query_all_with_connection exists"
    )
    params = list(inspect.signature(method).parameters)
    assert params[:3] == ["self", "connection", "query"], (
        "assumption broken: execute_query_all_with_connection(connection, query, **arguments)"
    )
