"""Offload-directory figures: every job's store and the total, with free disk."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.auth import AdminDep
from service.api.deps import SettingsDep
from service.api.schemas import problems
from service.offload.usage import offload_usage

router = APIRouter(prefix="/v1", tags=["offload"])


@router.get("/offload", responses=problems(401, 403))
def get_offload(settings: SettingsDep, _admin: AdminDep) -> dict[str, Any]:
    """Admin keys only: the figures name every tenant's jobs."""
    return offload_usage(settings)
