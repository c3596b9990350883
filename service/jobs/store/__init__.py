"""The job store: SQLAlchemy Core over SQLite (default) or PostgreSQL, two tables.

Where everything is:

- ``schema.py``: the tables (``jobs``, ``job_totals``), the row <-> :class:`Job` mapping, the
  engine's settings and the one write lock (:func:`~service.jobs.store.schema.lock_writes`).
- ``reads.py``: one job, a page, the jobs that changed, counts and id lists.
- ``lifecycle.py``: queued -> running -> ended, re-queued, files removed; the concurrency
  rules (every state change is one UPDATE guarded by the expected status).
- the SQL of each feature, as functions on a connection: ``admission.py`` (queue and tenant
  limits), ``reuse.py`` (result reuse, :mod:`service.jobs.reuse`), ``callbacks.py``
  (completion callbacks, :mod:`service.jobs.callbacks`), ``totals.py`` (running totals,
  :mod:`service.jobs.totals`).
- ``job_store.py``: :class:`JobStore`, the façade the rest of the service calls; it opens
  connections and transactions and hands them to the functions above.
- ``migrations/``: the tables' history as alembic revisions, which
  :meth:`JobStore.create_schema` runs.

Secrets are never written here.
"""

from service.jobs.store.admission import Admission
from service.jobs.store.job_store import JobStore
from service.jobs.store.reuse import ReuseAction, ReuseDecision
from service.jobs.store.schema import job_totals, jobs_table, make_engine, metadata, utcnow

__all__ = [
    "Admission", "JobStore", "ReuseAction", "ReuseDecision", "job_totals", "jobs_table",
    "make_engine", "metadata", "utcnow",
]
