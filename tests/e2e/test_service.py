"""The service end to end on the embedded default: a real server process on loopback, SQLite,
the local pool of job processes, real tiny checkpoints written by transformers."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from tests.fixtures.models import (
    build_checkpoint,
    build_tiny_model,
    copy_tree,
    make_lying_offsets,
    sample_inputs,
    truncate_file,
    write_index_with_missing_shard,
    write_pickle_with_object,
)
from tests.fixtures.service import ServiceProcess, running_service

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allowed local root, holding good and broken checkpoints."""
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    build_checkpoint(root / "llama-bin-sharded", "llama", "bin-sharded")
    build_checkpoint(root / "bert", "bert", "safetensors")
    truncate_file(copy_tree(root / "llama", root / "truncated") / "model.safetensors")
    make_lying_offsets(copy_tree(root / "llama", root / "lying") / "model.safetensors")
    pickle_dir = root / "evil-pickle"
    pickle_dir.mkdir()
    write_pickle_with_object(pickle_dir / "pytorch_model.bin")
    build_checkpoint(root / "missing-shard", "llama", "safetensors-sharded")
    write_index_with_missing_shard(root / "missing-shard")
    return root


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("data")
    with running_service(data, [root], env={"MODELPREP_WORKERS": "2"}) as svc:
        yield svc


def submit(svc: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    with svc.client() as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    return job


def download_all(svc: ServiceProcess, job: dict[str, Any], out: Path) -> Path:
    with svc.client() as client:
        for artifact in job["artifacts"]:
            target = out / artifact["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with client.stream("GET", artifact["url"]) as response:
                assert response.status_code == 200
                with target.open("wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
            assert hashlib.sha256(target.read_bytes()).hexdigest() == artifact["sha256"]
            assert target.stat().st_size == artifact["size"]
    return out


def test_llama_is_prepared_to_bfloat16_and_loads_with_transformers(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    job = submit(
        service,
        {"source": f"file://{root / 'llama'}",
         "exports": [{"format": "safetensors", "dtype": "bfloat16"}]},
    )
    assert job["status"] == "queued"
    done = service.wait_for(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["phase"] == "done" and done["finished_at"] and done["started_at"]
    assert done["metrics"]["peak_rss_bytes"] > 0
    paths = {a["path"] for a in done["artifacts"]}
    assert {"manifest.json", "safetensors/model.safetensors", "safetensors/config.json",
            "safetensors/tokenizer.json"} <= paths
    # the finished job counts every file it published, manifest included
    assert done["progress"] == {"done": len(paths), "total": len(paths), "unit": "files"}

    out = download_all(service, done, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["uri"] == f"file://{root / 'llama'}"
    assert manifest["model"]["tensor_count"] > 0
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    for path, digest in listed.items():
        assert hashlib.sha256((out / path).read_bytes()).hexdigest() == digest

    exported = AutoModelForCausalLM.from_pretrained(out / "safetensors")
    assert exported.dtype == torch.bfloat16
    source = build_tiny_model("llama")
    inputs = sample_inputs("llama")
    with torch.no_grad():
        want = source.to(torch.bfloat16)(**inputs).logits.float()
        got = exported(**inputs).logits.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sharded_pickle_bert_round_trips_exactly_in_float32(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    job = submit(service, {"source": f"file://{root / 'llama-bin-sharded'}",
                           "exports": [{"format": "safetensors", "max_shard_size": "20KB"}]})
    bert = submit(service, {"source": f"file://{root / 'bert'}",
                            "exports": [{"format": "safetensors"}]})
    done = service.wait_for(job["id"])
    assert done["status"] == "succeeded", done["error"]
    out = download_all(service, done, tmp_path / "llama")
    index = json.loads((out / "safetensors" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = AutoModelForCausalLM.from_pretrained(out / "safetensors")
    inputs = sample_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(
            exported(**inputs).logits, build_tiny_model("llama")(**inputs).logits, rtol=0, atol=0
        )

    done_bert = service.wait_for(bert["id"])
    assert done_bert["status"] == "succeeded", done_bert["error"]
    out_bert = download_all(service, done_bert, tmp_path / "bert")
    exported_bert = AutoModel.from_pretrained(out_bert / "safetensors")
    inputs = sample_inputs("bert")
    with torch.no_grad():
        torch.testing.assert_close(
            exported_bert(**inputs).last_hidden_state,
            build_tiny_model("bert")(**inputs).last_hidden_state, rtol=0, atol=0,
        )


def test_one_job_exports_safetensors_gguf_and_nnef_each_verified(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    """Three formats from one download, one meta build and one offload store; each export
    verified (safetensors against the source, GGUF read back, NNEF run in tract)."""
    import numpy as np
    from gguf import GGUFReader

    from service.exporters.nnef.tract_cli import load_runnable, run_bundle

    job = submit(service, {"source": f"file://{root / 'llama'}", "exports": [
        {"format": "safetensors", "dtype": "float16"},
        {"format": "gguf", "type": "q8_0"},
        {"format": "nnef", "compression": "q4_0"}]})
    done = service.wait_for(job["id"])
    assert done["status"] == "succeeded", done["error"]
    out = download_all(service, done, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    safetensors, gguf, nnef = manifest["exports"]
    assert safetensors["verify"]["passed"]
    assert gguf["verification"]["tensors_checked"] == gguf["tensors"]
    assert nnef["verify"]["max_abs_err"] <= nnef["verify"]["tolerance"]
    assert nnef["verify"]["tract_peak_rss_bytes"] > 0

    reader = GGUFReader(out / "gguf" / gguf["file"])
    assert len(reader.tensors) == gguf["tensors"]
    runnable = load_runnable(out / "nnef" / "model.nnef.tgz")
    with np.load(out / "nnef" / "example_inputs.npz") as bundle:
        outputs = run_bundle(runnable, {k: bundle[k] for k in bundle.files})
    with np.load(out / "nnef" / "example_outputs.npz") as bundle:
        expected = [bundle[k] for k in bundle.files]
    assert np.allclose(outputs[0], expected[0], atol=1e-2)


def test_artifact_download_supports_range_and_etag(service: ServiceProcess, root: Path) -> None:
    done = service.wait_for(submit(service, {"source": f"file://{root / 'llama'}",
                                             "exports": [{"format": "safetensors"}]})["id"])
    artifact = next(a for a in done["artifacts"] if a["path"].endswith("model.safetensors"))
    with service.client() as client:
        full = client.get(artifact["url"])
        assert full.headers["etag"] == f'"{artifact["sha256"]}"'
        part = client.get(artifact["url"], headers={"Range": "bytes=10-19"})
        assert part.status_code == 206 and part.content == full.content[10:20]
        again = client.get(artifact["url"], headers={"If-None-Match": full.headers["etag"]})
        assert again.status_code == 304


@pytest.mark.parametrize(
    "path", ["../../../modelprep.db", "..%2F..%2Fmodelprep.db", "%2Fetc%2Fpasswd", "nope.bin"]
)
def test_artifact_paths_outside_the_job_are_refused(
    service: ServiceProcess, root: Path, path: str
) -> None:
    done = service.wait_for(submit(service, {"source": f"file://{root / 'llama'}",
                                             "exports": [{"format": "safetensors"}]})["id"])
    with service.client() as client:
        response = client.get(f"/v1/jobs/{done['id']}/artifacts/{path}")
    assert response.status_code in (403, 404)
    assert response.headers["content-type"] == PROBLEM
    assert b"SQLite" not in response.content


@pytest.mark.parametrize(
    ("name", "error_type"),
    [
        ("truncated", "corrupt_checkpoint"),
        ("lying", "corrupt_checkpoint"),
        ("evil-pickle", "unsafe_pickle"),
        ("missing-shard", "missing_shard"),
    ],
)
def test_bad_checkpoints_fail_the_job_with_a_typed_error(
    service: ServiceProcess, root: Path, name: str, error_type: str
) -> None:
    bad = submit(service, {"source": f"file://{root / name}", "exports": [{"format": "safetensors"}]})
    good = submit(service, {"source": f"file://{root / 'llama'}",
                            "exports": [{"format": "safetensors"}]})
    failed = service.wait_for(bad["id"])
    assert failed["status"] == "failed"
    assert failed["error"]["type"] == error_type, failed["error"]
    assert failed["artifacts"] == []
    assert not (service.data_dir / "jobs" / bad["id"] / "artifacts").exists()
    assert service.wait_for(good["id"])["status"] == "succeeded"
    assert "unpickled arbitrary code" not in service.logs()


@pytest.mark.parametrize(
    ("body", "status", "type_suffix"),
    [
        ({"source": "file:///etc", "exports": [{"format": "safetensors"}]}, 422,
         "source_not_allowed"),
        ({"source": "ftp://x/y", "exports": [{"format": "safetensors"}]}, 422, "invalid_request"),
        ({"source": "file:///x", "exports": [{"format": "tflite"}]}, 422, "invalid_request"),
        ({"source": "file:///x", "exports": [{"format": "safetensors", "dtype": "float8"}]}, 422,
         "invalid_request"),
        ({"source": "file:///x", "exports": []}, 422, "invalid_request"),
        ({"exports": [{"format": "safetensors"}]}, 422, "invalid_request"),
    ],
)
def test_bad_requests_get_problem_json(
    service: ServiceProcess, body: dict[str, Any], status: int, type_suffix: str
) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["type"].endswith(type_suffix) and problem["status"] == status
    assert problem["detail"]


def test_missing_source_and_escaping_symlink_are_refused(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    build_checkpoint(outside, "llama")
    link = root / "escape"
    link.symlink_to(outside)
    with service.client() as client:
        for source, suffix in ((f"file://{link}", "source_not_allowed"),
                               (f"file://{root / 'nope'}", "source_not_found")):
            response = client.post(
                "/v1/jobs", json={"source": source, "exports": [{"format": "safetensors"}]}
            )
            assert response.status_code == 422 and response.json()["type"].endswith(suffix)


def test_malformed_json_is_a_400_problem(service: ServiceProcess) -> None:
    with service.client() as client:
        response = client.post(
            "/v1/jobs", content=b'{"source": ', headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert response.headers["content-type"] == PROBLEM


def test_unknown_job_and_route_are_problems(service: ServiceProcess) -> None:
    with service.client() as client:
        for url in ("/v1/jobs/" + "0" * 32, "/v1/nothing-here"):
            response = client.get(url)
            assert response.status_code == 404
            assert response.headers["content-type"] == PROBLEM


def test_jobs_list_filters_and_pages(service: ServiceProcess, root: Path) -> None:
    ids = [submit(service, {"source": f"file://{root / 'llama'}",
                            "exports": [{"format": "safetensors"}]})["id"] for _ in range(3)]
    for job_id in ids:
        service.wait_for(job_id)
    with service.client() as client:
        seen: list[str] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"status": "succeeded", "limit": 2}
            if cursor:
                params["cursor"] = cursor
            page = client.get("/v1/jobs", params=params).json()
            seen += [j["id"] for j in page["items"]]
            assert all(j["status"] == "succeeded" for j in page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert set(ids) <= set(seen) and len(seen) == len(set(seen))
        bad = client.get("/v1/jobs", params={"status": "bogus"})
        assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM


def test_hf_token_is_never_stored_or_echoed(service: ServiceProcess, root: Path) -> None:
    token = "hf_secretTOKEN1234567890"
    job = submit(service, {"source": f"file://{root / 'llama'}", "hf_token": token,
                           "exports": [{"format": "safetensors"}]})
    done = service.wait_for(job["id"])
    assert token not in json.dumps(job) and token not in json.dumps(done)
    db = sqlite3.connect(service.data_dir / "modelprep.db")
    dump = "\n".join(db.iterdump())
    assert token not in dump
    assert token not in service.logs()


def test_health_endpoints(service: ServiceProcess) -> None:
    with service.client() as client:
        assert client.get("/healthz").json()["status"] == "ok"
        ready = client.get("/readyz").json()
        assert ready["status"] == "ok" and ready["checks"]["database"] == "ok"


def test_queue_limit_answers_429_with_retry_after(root: Path, tmp_path: Path) -> None:
    with running_service(tmp_path / "data", [root], env={"MODELPREP_MAX_QUEUED": "0"}) as svc:
        with svc.client() as client:
            response = client.post("/v1/jobs", json={"source": f"file://{root / 'llama'}",
                                                     "exports": [{"format": "safetensors"}]})
        assert response.status_code == 429
        assert response.headers["content-type"] == PROBLEM
        assert int(response.headers["retry-after"]) > 0
