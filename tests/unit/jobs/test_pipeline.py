"""The pipeline in-process (an InMemoryContext instead of the store): phases, manifest, verify."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from service.errors import UnsupportedExport
from service.jobs.layout import JobLayout
from service.jobs.pipeline import check_spec, run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext, Phase
from tests.fixtures.models import build_checkpoint


def run(tmp_path: Path, body: dict[str, Any]) -> tuple[InMemoryContext, dict[str, Any]]:
    root = tmp_path / "models"
    source = build_checkpoint(root / "llama", "llama", "bin")
    settings = Settings(data_dir=tmp_path / "data", local_roots=[root])
    layout = JobLayout.for_job(settings, "c" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="c" * 32)
    spec = JobSpec.model_validate({"source": f"file://{source}", **body})
    run_pipeline(spec, ctx, layout)
    return ctx, json.loads((layout.artifacts / "manifest.json").read_text())


def test_a_verified_job_builds_offloads_and_checks_each_safetensors_export(
    tmp_path: Path,
) -> None:
    ctx, manifest = run(tmp_path, {"exports": [{"format": "safetensors", "dtype": "bfloat16"}],
                                   "max_memory": "100KB"})
    assert list(dict.fromkeys(ctx.phases_seen)) == [Phase.DOWNLOAD, Phase.READ, Phase.BUILD, Phase.OFFLOAD,
                               Phase.EXPORT, Phase.VERIFY, Phase.FINALIZE]
    check = manifest["exports"][0]["verify"]
    assert check["passed"] and check["dtype"] == "bfloat16" and check["max_rel_error"] > 0
    assert manifest["model"]["architecture"] == "LlamaForCausalLM"
    assert manifest["model"]["keys"]["missing"] == []
    offload = ctx.details["offload"]
    assert offload["tensors_written"] > 0  # a pickle source is written once into the store
    assert not (tmp_path / "data" / "jobs" / ("c" * 32) / "offload").exists()


def test_verify_false_skips_the_offload_and_every_exporters_own_check(tmp_path: Path) -> None:
    ctx, manifest = run(tmp_path, {"verify": False, "exports": [{"format": "safetensors"}]})
    assert Phase.VERIFY not in ctx.phases_seen and Phase.OFFLOAD not in ctx.phases_seen
    assert "verify" not in manifest["exports"][0]


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


def test_exports_are_judged_at_submission_only_when_the_config_is_at_hand(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path)
    hub = JobSpec.model_validate({"source": "hf://org/tiny", "exports": [{"format": "nnef"}]})
    check_spec(hub, settings, None, config_known=False)  # not downloaded yet: judged in the job
    with pytest.raises(UnsupportedExport):
        check_spec(hub, settings, None, config_known=True)  # known to have no config.json
    whisper = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]}
    gguf = JobSpec.model_validate({"source": "hf://org/tiny", "exports": [{"format": "gguf"}]})
    with pytest.raises(UnsupportedExport):
        check_spec(gguf, settings, whisper, config_known=True)


def test_a_checkpoint_without_config_is_exported_and_says_why_it_was_not_verified(
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    source = build_checkpoint(root / "llama", "llama", "safetensors")
    (source / "config.json").unlink()
    settings = Settings(data_dir=tmp_path / "data", local_roots=[root])
    layout = JobLayout.for_job(settings, "d" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="d" * 32)
    spec = JobSpec.model_validate(
        {"source": f"file://{source}", "exports": [{"format": "safetensors", "dtype": "float16"}]}
    )
    run_pipeline(spec, ctx, layout)
    manifest = json.loads((layout.artifacts / "manifest.json").read_text())
    assert manifest["model"]["buildable"] is False
    assert "config" in manifest["exports"][0]["verify"]["skipped"]
    assert (layout.artifacts / "safetensors" / "model.safetensors").is_file()
