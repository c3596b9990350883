"""Typed dependencies: the routes get the domain objects the app factory built."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.config import Settings
from service.jobs.service import JobService


def _jobs(request: Request) -> JobService:
    jobs: JobService = request.app.state.jobs
    return jobs


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


JobsDep = Annotated[JobService, Depends(_jobs)]
SettingsDep = Annotated[Settings, Depends(_settings)]
