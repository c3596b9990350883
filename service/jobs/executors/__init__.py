"""What runs jobs: the local pool (default) or procrastinate workers, chosen by the settings."""

from __future__ import annotations

from service.config import Settings
from service.jobs.executors.base import Executor
from service.jobs.store import JobStore


def executor_for(settings: Settings, store: JobStore) -> Executor:
    """The executor ``settings.executor`` names, bound to ``store``."""
    if settings.executor == "procrastinate":
        from service.jobs.executors.distributed import ProcrastinateExecutor

        return ProcrastinateExecutor(settings, store)
    from service.jobs.executors.local import LocalExecutor

    return LocalExecutor(settings, store)
