"""Fixtures several job-layer test modules share (a module's own fixture of the same name wins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs.store import JobStore


@pytest.fixture
def base(tmp_path: Path, llama_safetensors_dir: Path) -> Settings:
    return Settings(data_dir=tmp_path, local_roots=[llama_safetensors_dir.parent])


@pytest.fixture
def store(base: Settings) -> Iterator[JobStore]:
    store = JobStore.from_url(base.sqlalchemy_url)
    store.create_schema()
    yield store
    store.dispose()
