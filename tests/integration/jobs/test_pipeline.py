"""The pipeline in-process with a GGUF export: its checks and its converter need the built
llama.cpp (the rest of the pipeline's tests are tests/unit/jobs/test_pipeline.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.stage import Phase
from tests.unit.jobs.test_pipeline import run


def test_exports_share_one_meta_build_and_one_offload_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors, GGUF and NNEF in one job: one download, one meta build, one store, which
    the NNEF export reads every weight from (unverified: nothing else reads the store)."""
    from service.offload import build, store

    builds: list[str] = []  # config class of each meta build
    stores: list[store.OffloadStore] = []
    loads: list[str] = []
    real_build, real_open, real_load = (
        build.build_meta_model, store.open_job_store, store.OffloadStore.load
    )

    def build_meta_model(*args: Any, **kwargs: Any) -> Any:
        builds.append(type(args[0]).__name__)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(build, "build_meta_model", build_meta_model)

    def open_store(*args: Any, **kwargs: Any) -> store.OffloadStore:
        stores.append(real_open(*args, **kwargs))
        return stores[-1]

    def load(self: store.OffloadStore, name: str, dtype: Any = None) -> Any:
        loads.append(name)
        return real_load(self, name, dtype)

    monkeypatch.setattr(store, "open_job_store", open_store)
    monkeypatch.setattr(store.OffloadStore, "load", load)
    ctx, manifest = run(tmp_path, {"verify": False, "exports": [
        {"format": "safetensors"}, {"format": "gguf", "type": "f16"}, {"format": "nnef"}]})
    assert len(builds) == 1 and len(stores) == 1
    assert set(loads) == set(stores[0].names())  # every weight NNEF exported came from it
    assert Phase.OFFLOAD in ctx.phases_seen and Phase.VERIFY not in ctx.phases_seen
    assert [e["format"] for e in manifest["exports"]] == ["safetensors", "gguf", "nnef"]
    assert manifest["exports"][2]["verify"] is None
    assert ctx.details["offload"]["tensors_written"] > 0  # a pickle source: written once
