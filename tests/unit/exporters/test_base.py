"""A format is its package (:mod:`service.exporters.base`): a class that lacks what every format
declares fails where it is defined, a format the service does not know raises, and writing a
package and importing it once is all a new format takes.

The toy format (``tests/fixtures/toy_format``: a spec, an exporter, a plan, not a line
elsewhere) is imported in a process of its own, since the registry is the process's and no other
test may see the toy. There a real job runs it: the job spec takes it, the job's plan is the
toy's own formula, its producers key the reuse of its artifacts and are on its model card, and
the pipeline writes its file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from service.checkpoint.headers import CheckpointHeaders
from service.errors import UnsupportedExport
from service.exporters import exporter_for, plan_export, registry
from service.exporters.base import (
    Exporter,
    ExportInputs,
    ExportResult,
    ExportSpec,
    Producers,
)
from service.plan import ExportPlan, PlanInputs
from service.plan.terms import JOB_BASE_BYTES, JOB_SHARED_BYTES
from service.stage import JobContext

ROOT = Path(__file__).resolve().parents[3]

TOY_JOB = """
import json, sys
from pathlib import Path

import tests.fixtures.toy_format  # the one import a format takes (service/exporters/__init__.py)
from pydantic import ValidationError

from service.config import Settings
from service.exporters import registry
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.planning import plan_spec, source_headers
from service.jobs.spec import JobSpec
from service.jobs.versions import producers
from service.stage import InMemoryContext
from tests.fixtures.models import build_checkpoint

tmp = Path(sys.argv[1])
source = build_checkpoint(tmp / "models" / "llama", "llama", "safetensors")
settings = Settings(data_dir=tmp / "data", local_roots=[tmp / "models"])
body = {"source": f"file://{source}", "verify": False, "exports": [{"format": "toy", "indent": 2}]}
spec = JobSpec.model_validate(body)
try:
    JobSpec.model_validate({**body, "exports": [{"format": "toy", "indent": 99}]})
    refused = None
except ValidationError as exc:
    refused = [".".join(map(str, e["loc"])) for e in exc.errors()]
headers = source_headers(spec, settings)
plan = plan_spec(spec, headers, settings)
layout = JobLayout.for_job(settings, "e" * 32)
layout.prepare()
run_pipeline(spec, InMemoryContext(settings=settings, work_dir=layout.work, job_id="e" * 32),
             layout)
written = next(layout.artifacts.rglob("tensors.json"))
print(json.dumps({
    "formats": sorted(registry()),
    "refused": refused,
    "schema": sorted(JobSpec.model_json_schema()["$defs"]),
    "names": [t.name for t in headers.tensors],
    "plan": plan.as_dict()["exports"][0],
    "producers": producers(),
    "tensors": json.loads(written.read_text()),
    "indented": written.read_text().startswith('{\\n  "'),
    "card": (layout.artifacts / "README.md").read_text(),
}))
"""


@pytest.fixture(scope="module")
def toy_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a process that imported the toy format once saw of it, running one toy job."""
    result = subprocess.run(
        [sys.executable, "-c", TOY_JOB, str(tmp_path_factory.mktemp("toy"))],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return found


def test_a_new_format_is_its_package_imported_once(toy_job: dict[str, Any]) -> None:
    assert "toy" in toy_job["formats"] and "toy" not in registry()  # the test process: no toy
    assert toy_job["refused"] == ["exports.0.toy.indent"]  # the toy spec's own validation
    assert "ToySpec" in toy_job["schema"]  # the API's document takes it too
    assert toy_job["tensors"] and set(toy_job["tensors"]) == set(toy_job["names"])
    assert toy_job["indented"]


def test_a_new_formats_plan_is_its_own_formula(toy_job: dict[str, Any]) -> None:
    plan = toy_job["plan"]
    artifact = sum(len(name) + 64 for name in toy_job["names"]) * 2  # indented: twice
    assert plan["format"] == "toy" and plan["artifact_bytes"] == artifact
    assert plan["job_peak_rss_bytes"] == JOB_BASE_BYTES + artifact
    assert plan["notes"] == [f"toy: base + {len(toy_job['names'])} lines of JSON ({artifact} bytes)"]
    assert plan["job_shared_bytes"] == JOB_SHARED_BYTES  # what every format's plan shares


def test_a_new_formats_producers_key_reuse_and_are_on_its_card(toy_job: dict[str, Any]) -> None:
    assert toy_job["producers"]["toy-writer"] == "1.0"
    assert {"modelprep", "torch", "gguf", "llama.cpp", "tract", "onnx"} <= set(toy_job["producers"])
    assert "| toy-writer | `1.0` |" in toy_job["card"]


class _Spec(ExportSpec):
    format: Literal["probe"] = "probe"


def _plan(self: Exporter, spec: ExportSpec, inputs: PlanInputs) -> ExportPlan:
    raise AssertionError("never planned")


def _export(
    self: Exporter, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
) -> ExportResult:
    raise AssertionError("never exported")


def _define(**members: Any) -> type[Exporter]:
    """An exporter class with ``members``, defined as a ``class`` statement would."""
    return type("Probe", (Exporter,), members)


FULL: dict[str, Any] = {
    "format": "probe", "spec_type": _Spec, "producers": Producers(), "plan": _plan,
    "export": _export,
}  # fmt: skip


def test_a_complete_exporter_class_is_defined_and_never_registered_by_that() -> None:
    probe = _define(**FULL)
    assert issubclass(probe, Exporter) and "probe" not in registry()


@pytest.mark.parametrize("missing", ["plan", "producers", "export", "spec_type", "format"])
def test_an_exporter_class_that_lacks_a_declaration_fails_where_it_is_defined(
    missing: str,
) -> None:
    with pytest.raises(TypeError, match=f"does not declare {missing}"):
        _define(**{k: v for k, v in FULL.items() if k != missing})


def test_an_exporter_whose_spec_carries_another_format_tag_fails_where_it_is_defined() -> None:
    with pytest.raises(TypeError, match="must default to 'other'"):
        _define(**{**FULL, "format": "other"})


def test_a_base_shared_by_formats_says_it_is_abstract() -> None:
    class Shared(Exporter, abstract=True):
        producers: ClassVar[Producers] = Producers(distributions=("torch",))

    assert not hasattr(Shared, "format")


def test_a_format_nobody_registered_raises_rather_than_being_planned_as_another() -> None:
    headers = CheckpointHeaders("safetensors", {"model.safetensors": 8})
    with pytest.raises(UnsupportedExport, match="no exporter for the format 'nope'"):
        plan_export(ExportSpec(format="nope"), headers, 1 << 30)
    with pytest.raises(UnsupportedExport, match="known: gguf, nnef, onnx, safetensors"):
        exporter_for("nope")
