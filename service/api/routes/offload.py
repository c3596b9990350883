"""Offload-directory figures: every job's store and the total, with free disk."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.auth import AdminDep
from service.api.deps import JobsDep
from service.api.schemas import problems

router = APIRouter(prefix="/v1", tags=["offload"])


@router.get("/offload", responses=problems(401, 403))
def get_offload(jobs: JobsDep, _admin: AdminDep) -> dict[str, Any]:
    """Admin keys only: the figures name every tenant's jobs. Stores on other hosts (workers
    with no shared volume) are those their running jobs report through the database."""
    return jobs.offload_usage()
