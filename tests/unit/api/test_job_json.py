"""The job JSON shows the typed phase timeline and removal time exactly as the job document
always has: ``phases`` and ``deleted_at`` at its top level, present only once the job has them."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from service.api.schemas import JobOut
from service.jobs.model import Job, JobStatus, Phase, PhaseTiming

CREATED = datetime(2026, 11, 25, 8, 0, 0, 123456, tzinfo=UTC)


def job(**fields: object) -> Job:
    return Job(id="j", status=JobStatus.SUCCEEDED, phase=Phase.DONE, spec={}, created_at=CREATED,
               details={"source": {"uri": "file:///m"}}, **fields)  # type: ignore[arg-type]


def test_a_queued_job_has_neither_a_timeline_nor_a_removal_time() -> None:
    document = json.loads(JobOut.from_job(job()).json_bytes())
    assert "phases" not in document and "deleted_at" not in document
    assert document["source"] == {"uri": "file:///m"}


def test_the_timeline_and_the_removal_time_are_top_level_keys_in_their_wire_format() -> None:
    phases = (PhaseTiming(Phase.DOWNLOAD, CREATED, 0.25),
              PhaseTiming(Phase.EXPORT, CREATED, 1.5, peak_rss_bytes=7, cgroup_peak_bytes=9),
              PhaseTiming(Phase.FINALIZE, CREATED))
    document = json.loads(JobOut.from_job(job(phases=phases, deleted_at=CREATED)).json_bytes())
    assert document["phases"] == [
        {"phase": "download", "started_at": "2026-11-25T08:00:00.123456+00:00", "seconds": 0.25},
        {"phase": "export", "started_at": "2026-11-25T08:00:00.123456+00:00", "seconds": 1.5,
         "peak_rss_bytes": 7, "cgroup_peak_bytes": 9},
        {"phase": "finalize", "started_at": "2026-11-25T08:00:00.123456+00:00", "seconds": None},
    ]
    assert document["deleted_at"] == "2026-11-25T08:00:00.123456+00:00"
