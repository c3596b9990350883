from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings
from service.errors import ArtifactNotFound, PathOutsideRoot
from service.jobs.layout import JobLayout


@pytest.fixture
def layout(tmp_path: Path) -> JobLayout:
    layout = JobLayout.for_job(Settings(data_dir=tmp_path), "a" * 32)
    layout.prepare()
    (layout.staging / "safetensors").mkdir()
    (layout.staging / "safetensors" / "model.safetensors").write_bytes(b"x")
    layout.publish()
    (tmp_path / "secret.txt").write_text("outside")
    return layout


def test_published_artifact_is_served(layout: JobLayout) -> None:
    assert layout.artifact("safetensors/model.safetensors").read_bytes() == b"x"


@pytest.mark.parametrize(
    "path", ["../../../secret.txt", "/etc/passwd", "safetensors/../../work", "", "."]
)
def test_paths_leaving_the_artifacts_are_refused(layout: JobLayout, path: str) -> None:
    with pytest.raises((PathOutsideRoot, ArtifactNotFound)):
        layout.artifact(path)


def test_symlink_out_of_artifacts_is_refused(layout: JobLayout, tmp_path: Path) -> None:
    (layout.artifacts / "link").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(PathOutsideRoot):
        layout.artifact("link")


def test_job_ids_cannot_name_paths(tmp_path: Path) -> None:
    with pytest.raises(PathOutsideRoot):
        JobLayout.for_job(Settings(data_dir=tmp_path), "../etc")


def test_prepare_removes_a_previous_attempts_files(layout: JobLayout) -> None:
    (layout.offload).mkdir()
    (layout.offload / "stale.bin").write_bytes(b"0")
    layout.prepare()
    assert not layout.offload.exists() and not layout.artifacts.exists()
    assert layout.staging.is_dir() and not any(layout.staging.iterdir())
