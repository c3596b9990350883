"""Typed dependencies: the routes get the domain objects the app factory built.

``async`` because they do not block: FastAPI would otherwise run each in the thread pool."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.watch import JobWatch
from service.config import Settings
from service.jobs.service import JobService


async def _jobs(request: Request) -> JobService:
    jobs: JobService = request.app.state.jobs
    return jobs


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _watch(request: Request) -> JobWatch:
    watch: JobWatch = request.app.state.watch
    return watch


JobsDep = Annotated[JobService, Depends(_jobs)]
WatchDep = Annotated[JobWatch, Depends(_watch)]
SettingsDep = Annotated[Settings, Depends(_settings)]
