"""Offload-directory figures: every job's store and the total, with free disk."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import SettingsDep
from service.offload.usage import offload_usage

router = APIRouter(prefix="/v1", tags=["offload"])


@router.get("/offload")
def get_offload(settings: SettingsDep) -> dict[str, Any]:
    return offload_usage(settings)
