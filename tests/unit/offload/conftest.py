"""Shared pieces of the offload tests: settings under tmp_path and a context that records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.config import Settings
from service.stage import InMemoryContext
from tests.fixtures.models import Arch, build_tiny_model, sample_inputs


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "var")


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> InMemoryContext:
    return InMemoryContext(settings=settings, work_dir=tmp_path / "work")


def eager_output(arch: Arch, tied: bool = False) -> torch.Tensor:
    """The normally-loaded (fully in RAM) model's output on the shared sample inputs."""
    model = build_tiny_model(arch, tie_word_embeddings=tied)
    with torch.inference_mode():
        out = model(**sample_inputs(arch))
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out.last_hidden_state
