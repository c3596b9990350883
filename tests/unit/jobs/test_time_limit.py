"""A job's time limit: its own ``timeout`` may only lower the service's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from service.jobs.executors.process import time_limit
from service.jobs.model import Job, JobStatus, Phase
from service.jobs.store import utcnow


@pytest.mark.parametrize(("own", "service", "expected"), [
    (None, None, None), (5.0, None, 5.0), (None, 60.0, 60.0), (5.0, 60.0, 5.0), (600.0, 60.0, 60.0),
])
def test_the_smaller_of_the_job_and_service_limits_applies(
    tmp_path: Path, own: float | None, service: float | None, expected: float | None
) -> None:
    spec: dict[str, Any] = {"source": "file:///x", "exports": [{"format": "safetensors"}]}
    if own is not None:
        spec["timeout"] = own
    job = Job(id="a" * 32, status=JobStatus.QUEUED, phase=Phase.QUEUED, spec=spec,
              created_at=utcnow())
    assert time_limit(job, Settings(data_dir=tmp_path, job_timeout=service)) == expected
