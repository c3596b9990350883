"""The pipeline in-process (an InMemoryContext instead of the store): phases, manifest, verify."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
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
