"""ONNX export through the API: a real server on loopback, the local pool, the real
all-MiniLM-L6-v2 and a tiny GQA Llama; the downloaded files are run here by onnxruntime."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from tests.e2e.test_service import PROBLEM, download_all, submit
from tests.fixtures.models import build_checkpoint, copy_tree
from tests.fixtures.real_models import Variant, real_variant
from tests.fixtures.service import ServiceProcess, running_service
from tests.integration.exporters.test_onnx import _decode_in_ort, minilm_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    shutil.copytree(minilm_dir(), root / "minilm")
    # SmolLM2-135M's real weights (GQA 9/3, tied head stored under the output name, bfloat16,
    # sharded), its first 4 layers to stay inside the suite's budget.
    smollm2 = Variant(tie="output", layout="safetensors-sharded", layers=4)
    copy_tree(real_variant("smollm2", smollm2), root / "smollm2")
    broken = copy_tree(root / "llama", root / "wrong-shape")
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] *= 2  # the MLP weights no longer fit the architecture
    (broken / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with running_service(tmp_path_factory.mktemp("data"), [root]) as svc:
        yield svc


def test_real_minilm_is_exported_and_runs_in_onnxruntime_like_transformers(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    job = submit(service, {"source": f"file://{root / 'minilm'}", "exports": [{"format": "onnx"}]})
    done = service.wait_for(job["id"], timeout=300)
    assert done["status"] == "succeeded", done["error"]
    out = download_all(service, done, tmp_path)
    (export,) = json.loads((out / "manifest.json").read_text())["exports"]
    assert export["task"] == "feature-extraction" and export["dtype"] == "float32"
    assert export["verify"]["max_abs_err"] <= export["verify"]["tolerance"]
    assert export["verify"]["ort_peak_rss_bytes"] > 0

    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    session = ort.InferenceSession(str(out / "onnx" / "model.onnx"))
    (found,) = session.run(
        ["last_hidden_state"],
        {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy()),
         "token_type_ids": np.zeros_like(ids.numpy())},
    )  # fmt: skip
    with torch.no_grad():
        expected = AutoModel.from_pretrained(root / "minilm").eval()(input_ids=ids)
    assert np.abs(found - expected.last_hidden_state.numpy()).max() < 1e-4


def test_gqa_llama_job_exports_safetensors_and_onnx_from_one_store(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    job = submit(service, {"source": f"file://{root / 'llama'}", "exports": [
        {"format": "safetensors"}, {"format": "onnx", "dtype": "float16"}]})  # fmt: skip
    done = service.wait_for(job["id"], timeout=300)
    assert done["status"] == "succeeded", done["error"]
    out = download_all(service, done, tmp_path)
    _, export = json.loads((out / "manifest.json").read_text())["exports"]
    assert export["task"] == "text-generation-with-past" and export["dtype"] == "float16"
    assert all(export["verify"]["argmax_agreed"])
    assert {f"onnx/{n}" for n in ("model.onnx", "model.onnx_data", "config.json")} <= {
        a["path"] for a in done["artifacts"]
    }
    prompt = [11, 40, 90, 3]
    model = AutoModelForCausalLM.from_pretrained(root / "llama").eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    found = _decode_in_ort(out / "onnx" / "model.onnx", prompt, 4)
    assert found == expected[0, 4:].tolist()


def test_a_task_the_architecture_cannot_do_is_refused_at_submission(
    service: ServiceProcess, root: Path
) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": f"file://{root / 'llama'}",
            "exports": [{"format": "onnx", "task": "feature-extraction"}]})  # fmt: skip
    assert response.status_code == 422
    assert response.headers["content-type"].startswith(PROBLEM)
    assert response.json()["type"].endswith("unsupported_export")


def test_weights_that_do_not_fit_the_config_fail_the_job_without_artifacts(
    service: ServiceProcess, root: Path
) -> None:
    job = submit(service, {"source": f"file://{root / 'wrong-shape'}",
                           "exports": [{"format": "onnx"}]})  # fmt: skip
    done = service.wait_for(job["id"], timeout=300)
    assert done["status"] == "failed"
    assert done["error"]["type"] in {"weights_mismatch", "checkpoint_error"}, done["error"]
    assert done["artifacts"] == []


def test_real_smollm2_decodes_in_onnxruntime_like_pytorch(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    job = submit(service, {"source": f"file://{root / 'smollm2'}", "exports": [{"format": "onnx"}]})
    done = service.wait_for(job["id"], timeout=600)
    assert done["status"] == "succeeded", done["error"]
    out = download_all(service, done, tmp_path)
    (export,) = json.loads((out / "manifest.json").read_text())["exports"]
    assert export["task"] == "text-generation-with-past" and export["dtype"] == "float32"
    assert export["inputs"]["past_key_values.0.key"][1] == 3  # 3 KV heads of 9
    assert all(export["verify"]["argmax_agreed"]) and len(export["verify"]["tokens"]) == 4
    prompt = [1, 504, 3458, 282]
    model = AutoModelForCausalLM.from_pretrained(root / "smollm2", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    assert _decode_in_ort(out / "onnx" / "model.onnx", prompt, 4) == expected[0, 4:].tolist()
