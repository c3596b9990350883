"""A job's plan before it runs (``"dry_run": true``), held against what the job then measures:
a real ``modelprep serve``, the real corpus (all-MiniLM-L6, SmolLM2-135M), every prediction
within 25% of the figure the job records. A job whose plan does not fit is refused at
submission with the numbers; a hub source is planned from its headers, never downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.models import copy_tree
from tests.fixtures.real_models import real_model
from tests.fixtures.service import ServiceProcess, running_service

TOLERANCE = 0.25

CASES = [
    ("minilm", {"format": "safetensors"}),
    ("minilm", {"format": "onnx"}),
    ("minilm", {"format": "nnef"}),
    ("minilm", {"format": "gguf", "type": "f16"}),
    ("smollm2", {"format": "gguf", "type": "q8_0"}),
    ("smollm2", {"format": "safetensors"}),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: copy_tree(real_model(name), root / name) for name in ("minilm", "smollm2")}


@pytest.fixture(scope="module")
def service(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    root = next(iter(models.values())).parent
    with running_service(tmp_path_factory.mktemp("data"), [root]) as svc:
        yield svc


def _plan(service: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    with service.client() as client:
        before = client.get("/v1/jobs").json()["items"]
        response = client.post("/v1/jobs", json={**body, "dry_run": True})
        assert response.status_code == 200, response.text
        plan: dict[str, Any] = response.json()
        assert client.get("/v1/jobs").json()["items"] == before, "a dry run created a job"
    return plan


def _close(what: str, predicted: int, measured: int) -> None:
    assert abs(predicted - measured) <= TOLERANCE * measured, (
        f"{what}: predicted {predicted / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB "
        f"({predicted / measured - 1:+.0%})"
    )


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("model", "export"), CASES, ids=[f"{m}-{e['format']}" for m, e in CASES])
def test_the_plan_predicts_what_the_job_measures_within_25_percent(
    service: ServiceProcess, models: dict[str, Path], model: str, export: dict[str, Any]
) -> None:
    body = {"source": models[model].as_uri(), "exports": [export], "reuse": False}
    plan = _plan(service, body)
    assert plan["fits"] and plan["refusals"] == []
    (planned,) = plan["exports"]
    with service.client() as client:
        job = client.post("/v1/jobs", json=body).json()
    done = service.wait_for(job["id"], timeout=900)
    assert done["status"] == "succeeded", done["error"]
    manifest = json.loads(
        (service.data_dir / "jobs" / job["id"] / "artifacts" / "manifest.json").read_text()
    )
    summary = manifest["exports"][0]

    _close("the job's peak RSS", plan["peak_rss_bytes"], done["metrics"]["peak_rss_bytes"])
    # each child's own peak (run_child: not the job's resident memory it started from)
    children = {c["name"]: c["peak_rss_bytes"] for c in planned["children"]}
    if "onnxruntime" in children:
        _close("onnxruntime", children["onnxruntime"], summary["verify"]["ort_peak_rss_bytes"])
    if "tract" in children:
        _close("tract", children["tract"], summary["verify"]["tract_peak_rss_bytes"])
    if "llama-perplexity" in children:
        measured = summary["verify"]["logits"]["llama_cpp_peak_rss_bytes"]
        _close("llama-perplexity", children["llama-perplexity"], measured)
    artifacts = sum(a["size"] for a in done["artifacts"] if a["path"] != "manifest.json")
    _close("artifact bytes", plan["disk"]["artifact_bytes"], artifacts)
    assert planned["verification"] == {"safetensors": "reference", "gguf": "read_back",
                                       "onnx": "whole", "nnef": "whole"}[export["format"]]


def test_a_job_that_does_not_fit_its_budget_is_refused_at_submission_with_numbers(
    models: dict[str, Path], tmp_path: Path
) -> None:
    env = {"MODELPREP_JOB_MEMORY": str(300 << 20)}
    with running_service(tmp_path / "data", [models["minilm"].parent], env=env) as service:
        body = {"source": models["minilm"].as_uri(), "exports": [{"format": "onnx"}]}
        plan = _plan(service, body)
        assert not plan["fits"] and plan["memory_budget_bytes"] == 300 << 20
        with service.client() as client:
            response = client.post("/v1/jobs", json=body)
            assert response.status_code == 422, response.text
            problem = response.json()
            assert problem["type"].endswith("/plan_does_not_fit")
            assert "0.29 GiB budget" in problem["detail"] and "onnxruntime" in problem["detail"]
            assert client.get("/v1/jobs").json()["items"] == []


def test_a_hub_source_is_planned_from_its_headers_without_downloading_it(
    local_hub: LocalHub, models: dict[str, Path], tmp_path: Path
) -> None:
    local_hub.create_repo("org/minilm-plan", files_of(models["minilm"]))
    env = {"MODELPREP_HF_ENDPOINT": local_hub.endpoint, "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    exports = [{"format": "onnx"}, {"format": "gguf", "type": "f16"}]
    with running_service(tmp_path / "data", [models["minilm"].parent], env=env) as service:
        remote = _plan(service, {"source": "hf://org/minilm-plan", "exports": exports})
        local = _plan(service, {"source": models["minilm"].as_uri(), "exports": exports})
        assert not (service.data_dir / "cache").exists() or not any(
            (service.data_dir / "cache").rglob("*.safetensors")
        ), "the plan downloaded the weights"
    assert remote["exports"] == local["exports"]
    weights = (models["minilm"] / "model.safetensors").stat().st_size
    assert remote["disk"]["download_bytes"] >= weights and local["disk"]["download_bytes"] == 0
    assert remote["source"]["tensors"] == local["source"]["tensors"]
    # one ranged read of the shard, cut after its header
    assert local_hub.served("GET", "org/minilm-plan", "model.safetensors") == 1
