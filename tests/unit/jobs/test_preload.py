"""The forkserver's preload is derived from the code and what the exporters declare, and it is
enough: a real job forked from it imports no library and no service module that was not
preloaded (measured as the difference of sys.modules inside the job process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from service.config import Settings
from service.jobs.executors.preload import job_modules, service_modules
from service.jobs.executors.process import _FORKSERVER
from tests.fixtures.models import build_checkpoint


def _run_job_and_list_new_modules(tmp: str, body: dict[str, Any]) -> None:
    """Job-process stand-in: the pipeline on a real checkpoint, then the modules it imported."""
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    before = set(sys.modules)
    packages_before = {m.split(".")[0] for m in before}
    root = Path(tmp)
    settings = Settings(data_dir=root / "data", local_roots=[root / "models"])
    layout = JobLayout.for_job(settings, "d" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="d" * 32)
    spec = JobSpec.model_validate({"source": f"file://{root / 'models' / 'llama'}", **body})
    run_pipeline(spec, ctx, layout)
    new = sorted(set(sys.modules) - before)
    # What was not preloaded: a whole library first imported by the job, or a service module.
    missed = [m for m in new if m.startswith("service.") or m.split(".")[0] not in packages_before]
    (root / "not_preloaded.json").write_text(json.dumps({"missed": missed, "new": new}))


def not_preloaded_in_a_job(tmp_path: Path, body: dict[str, Any]) -> dict[str, list[str]]:
    build_checkpoint(tmp_path / "models" / "llama", "llama", "bin")
    process = _FORKSERVER.Process(target=_run_job_and_list_new_modules, args=(str(tmp_path), body))
    process.start()
    process.join(timeout=600)
    assert process.exitcode == 0, f"the job process ended with {process.exitcode}"
    result: dict[str, list[str]] = json.loads((tmp_path / "not_preloaded.json").read_text())
    return result


def test_a_verified_safetensors_job_imports_nothing_that_was_not_preloaded(
    tmp_path: Path,
) -> None:
    """The most common job: build on meta, offload, reference forward, export, parity check."""
    seen = not_preloaded_in_a_job(
        tmp_path, {"exports": [{"format": "safetensors"}], "max_memory": "100KB"}
    )
    assert seen["missed"] == [], (
        f"the job imported {seen['missed']} after the fork: derive them into the preload "
        "(service/jobs/executors/preload.py) or declare them in the exporter's modules()"
    )


def test_lazy_imports_of_the_stages_are_followed_but_a_rare_formats_are_not() -> None:
    modules = job_modules()
    # Function-level imports of the pipeline and the stages, found in their source:
    assert {"service.offload.dispatch", "service.offload.streaming",
            "service.exporters.safetensors.verify", "service.checkpoint.torch_pickle",
            "service.exporters.safetensors.writer"} <= set(modules)
    # Not torch-to-nnef's shim or the offloaded model: NNEF's and ONNX's exports import them
    # lazily.
    assert not {
        "service.shims.torch_to_nnef", "service.exporters.common.offloaded_model"
    } & set(modules)
    assert "service.jobs.store.migrations" not in modules  # no job migrates the schema


def test_modules_are_found_from_function_level_imports_without_importing_them() -> None:
    found = service_modules(["service.jobs.pipeline"])
    assert found[0] == "service.jobs.pipeline"
    assert "service.offload.build" in found  # imported only inside _build()
