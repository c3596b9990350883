"""Offload-directory figures per job and in total, for GET /v1/offload and the job JSON.

Read from disk only (``index.json``, ``metrics.json``, file sizes), so the API process can
report stores that job processes are writing without importing torch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from service.config import Settings
from service.errors import PathOutsideRoot
from service.offload.paths import INDEX_NAME, METRICS_NAME, job_store_dir

OFFLOAD_COUNTERS = (
    "bytes_on_disk",
    "files",
    "tensors_offloaded",
    "tensors_written",
    "tensors_referenced",
    "bytes_referenced",
    "reloads",
    "bytes_read",
)


def directory_usage(root: Path) -> dict[str, int]:
    """Bytes allocated on disk and regular files under ``root`` (symlinks are not followed)."""
    total = files = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue  # removed while we walked: a job ending
            files += 1
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return {"bytes": total, "files": files}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def store_usage(root: Path) -> dict[str, Any]:
    """The figures of one store directory, as far as its files tell."""
    usage = directory_usage(root)
    index = _read_json(root / INDEX_NAME)
    metrics = _read_json(root / METRICS_NAME)
    tensors = index.get("tensors", {}) if isinstance(index.get("tensors"), dict) else {}
    refs = [e for e in tensors.values() if isinstance(e, dict) and e.get("kind") == "ref"]
    owned = {
        e.get("path") for e in tensors.values() if isinstance(e, dict) and e.get("kind") == "owned"
    }
    return {
        "bytes_on_disk": usage["bytes"],
        "files": usage["files"],
        "tensors_offloaded": len(tensors),
        "tensors_written": len(owned),
        "tensors_referenced": len(refs),
        "bytes_referenced": sum(int(e.get("length", 0)) for e in refs),
        "reloads": int(metrics.get("reloads", 0)),
        "bytes_read": int(metrics.get("bytes_read", 0)),
    }


def offload_usage(settings: Settings) -> dict[str, Any]:
    """Every job's offload store and the total, plus free space where they live."""
    jobs: dict[str, Any] = {}
    jobs_dir = settings.jobs_dir
    if jobs_dir.is_dir():
        for job_dir in sorted(jobs_dir.iterdir()):
            try:
                store = job_store_dir(jobs_dir, job_dir.name)
            except PathOutsideRoot:
                continue  # a link out of the jobs directory is nobody's store
            if store.is_dir() and not store.is_symlink():
                jobs[job_dir.name] = store_usage(store)
    total: dict[str, Any] = {key: sum(j[key] for j in jobs.values()) for key in OFFLOAD_COUNTERS}
    total["stores"] = len(jobs)
    probe = jobs_dir if jobs_dir.exists() else settings.data_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    disk = shutil.disk_usage(probe)
    return {
        "jobs": jobs,
        "total": total,
        "quota_bytes_per_job": settings.offload_quota_bytes,
        "free_disk_bytes": disk.free,
        "disk_total_bytes": disk.total,
    }
