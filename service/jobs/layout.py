"""Where a job's files live under ``data_dir/jobs/<id>``.

``work/`` (scratch, staging of artifacts, the job's TMPDIR) and ``offload/`` exist only while the
job runs; ``artifacts/`` appears in one ``os.replace`` when every file of it is complete, so a
reader never sees a partial set.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from service.config import Settings
from service.errors import ArtifactNotFound, PathOutsideRoot
from service.offload.paths import job_store_dir

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class JobLayout:
    root: Path

    @classmethod
    def for_job(cls, settings: Settings, job_id: str) -> JobLayout:
        if not _JOB_ID.match(job_id):
            raise PathOutsideRoot(f"invalid job id {job_id!r}")
        return cls(settings.jobs_dir / job_id)

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def staging(self) -> Path:
        return self.work / "staging"

    @property
    def tmp(self) -> Path:
        return self.work / "tmp"

    @property
    def offload(self) -> Path:
        """The job's offload store, as :mod:`service.offload.paths` places it."""
        return job_store_dir(self.root.parent, self.root.name)

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def prepare(self) -> None:
        """Start an attempt from scratch: leftovers of an interrupted attempt are removed."""
        self.clean(keep_offload=False)
        shutil.rmtree(self.artifacts, ignore_errors=True)
        for path in (self.staging, self.tmp):
            path.mkdir(parents=True, exist_ok=True)

    def clean(self, keep_offload: bool = False) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if not keep_offload:
            shutil.rmtree(self.offload, ignore_errors=True)

    def discard(self, keep_offload: bool = False) -> None:
        """Remove everything a failed attempt wrote (the offload store only if not kept)."""
        self.clean(keep_offload=keep_offload)
        shutil.rmtree(self.artifacts, ignore_errors=True)

    def disk_bytes(self) -> int:
        """Bytes that removing the job's directory frees: a file another job still links
        (artifacts shared by result reuse) frees nothing until its last link goes."""
        total = 0
        for path in self.root.rglob("*"):
            try:
                if path.is_file() and not path.is_symlink():
                    st = path.stat()
                    total += st.st_size if st.st_nlink == 1 else 0
            except OSError:
                continue  # removed meanwhile
        return total

    def remove_artifacts(self) -> None:
        """Drop the local copy of artifacts published elsewhere (the artifact store)."""
        shutil.rmtree(self.artifacts, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def publish(self) -> None:
        """Move the complete staging directory into place as the job's artifacts."""
        shutil.rmtree(self.artifacts, ignore_errors=True)
        self.staging.replace(self.artifacts)

    def artifact(self, relative: str) -> Path:
        """The file ``relative`` inside artifacts/; anything resolving elsewhere is refused."""
        root = self.artifacts.resolve()
        candidate = (root / relative).resolve()
        if candidate == root or not candidate.is_relative_to(root):
            raise PathOutsideRoot(f"artifact path {relative!r} is outside the job's artifacts")
        if not candidate.is_file():
            raise ArtifactNotFound(f"no artifact {relative!r}")
        return candidate
