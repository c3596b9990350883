"""Shared pieces of the offload tests: settings under tmp_path, a context that records, and a
tiny checkpoint opened and built on meta, ready to dispatch (:func:`open_model`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import torch

from service.checkpoint import Checkpoint, open_checkpoint
from service.config import Settings
from service.offload.build import BuiltModel, build_on_meta
from service.offload.dispatch import DispatchResult, dispatch_checkpoint, dispatch_model
from service.offload.store import OffloadStore
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


@dataclass
class OpenModel:
    """A checkpoint open for the whole test, its model built on meta, and an offload store
    (made on first use) that may reference the checkpoint's files in place."""

    path: Path
    ckpt: Checkpoint
    built: BuiltModel
    ctx: InMemoryContext
    store_dir: Path

    @cached_property
    def store(self) -> OffloadStore:
        return OffloadStore(self.store_dir, allowed_roots=[self.path])

    def to_disk(self, **kwargs: Any) -> DispatchResult:
        """Every weight to the store (``dispatch_checkpoint`` with ``{"": "disk"}``)."""
        return dispatch_checkpoint(
            self.built.model, self.ckpt.reader, {"": "disk"}, self.store, self.ctx, **kwargs
        )

    def dispatch(self, store: OffloadStore | None = None, **kwargs: Any) -> DispatchResult:
        """The pipeline's offload phase (``dispatch_model``: a device map within a budget)."""
        return dispatch_model(
            self.built, self.ckpt.reader, store or self.store, self.ctx, **kwargs
        )


OpenModelFactory = Callable[[Path], OpenModel]


@pytest.fixture
def open_model(ctx: InMemoryContext, tmp_path: Path) -> Iterator[OpenModelFactory]:
    """``open_model(path)``: the checkpoint at ``path`` opened (closed after the test) and
    built on meta with ``ctx.settings``."""
    with ExitStack() as opened:

        def open_(path: Path) -> OpenModel:
            ckpt = opened.enter_context(open_checkpoint(path))
            built = build_on_meta(ckpt, ctx.settings)
            return OpenModel(path, ckpt, built, ctx, tmp_path / "store")

        yield open_
