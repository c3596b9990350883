"""Where a job's offload store lives and what its files are called: the one definition that the
job's layout (:mod:`service.jobs.layout`), the API's figures (:mod:`.usage`) and the store
itself (:mod:`.store`) share. No torch here: the API process imports it."""

from __future__ import annotations

from pathlib import Path

from service.errors import PathOutsideRoot

OFFLOAD_DIR = "offload"
"""A job's store: ``<jobs_dir>/<job_id>/offload``, next to its ``work/`` and ``artifacts/``."""
INDEX_NAME = "index.json"
METRICS_NAME = "metrics.json"
DATA_DIR = "data"


def job_store_dir(jobs_dir: Path, job_id: str) -> Path:
    """``<jobs_dir>/<job_id>/offload``; refuses ids that would leave ``jobs_dir``."""
    path = jobs_dir / job_id / OFFLOAD_DIR
    if not job_id or "/" in job_id or job_id in (".", "..") or not inside(path, jobs_dir):
        raise PathOutsideRoot(f"job id {job_id!r} does not name a directory under {jobs_dir}")
    return path


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (links followed) to somewhere under ``root``."""
    return path.resolve().is_relative_to(root.resolve())
