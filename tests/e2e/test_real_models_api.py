"""A real model through the HTTP API, as a user brings it: a real ``modelprep serve`` on loopback,
a ``file://`` source holding real SmolLM2 weights (its first 2 layers; tied head stored under the
output name, transformers-4 rope keys, float16, sharded), GGUF, NNEF and safetensors in one job,
every artifact downloaded (sha256 checked) and run by its consumer: llama.cpp, tract,
transformers. Bad inputs of the same model are refused typed: at submission when knowable."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.exporters.nnef.tract_cli import load_runnable, run_decode
from tests.e2e.test_service import PROBLEM, download_all, submit
from tests.fixtures.models import copy_tree
from tests.fixtures.real_models import COVERING_VARIANTS, real_model, real_variant
from tests.fixtures.service import ServiceProcess, running_service
from tests.integration.real_models.test_consumers import (
    PROBES,
    assert_same_continuation,
    hf_greedy,
    llama_greedy,
    llama_tokenize,
)

VARIANT = replace(COVERING_VARIANTS[1], layers=2)  # output-tied, v4 keys, float16, sharded


def _edit_config(ckpt: Path, **changes: object) -> Path:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    smollm2 = copy_tree(real_variant("smollm2", VARIANT), root / "smollm2")
    _edit_config(copy_tree(smollm2, root / "4000-layers"), num_hidden_layers=4000)
    _edit_config(copy_tree(smollm2, root / "gpt2"), model_type="gpt2",
                 architectures=["GPT2LMHeadModel"])  # fmt: skip
    both_bin = replace(COVERING_VARIANTS[2], layers=2)  # .bin shards: no header to read early
    _edit_config(copy_tree(real_variant("smollm2", both_bin), root / "wide-bin"), hidden_size=65536)
    copy_tree(real_model("minilm"), root / "minilm")
    return root


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with running_service(tmp_path_factory.mktemp("data"), [root]) as svc:
        yield svc


@pytest.mark.timeout(900)
def test_real_smollm2_over_http_gives_gguf_nnef_and_safetensors_that_their_consumers_run(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    source = root / "smollm2"
    job = submit(service, {"source": source.as_uri(), "exports": [
        {"format": "gguf", "type": "f16"}, {"format": "nnef", "decode_steps": 3},
        {"format": "safetensors"}]})  # fmt: skip
    done = service.wait_for(job["id"], timeout=800)
    assert done["status"] == "succeeded", done["error"]
    out = download_all(service, done, tmp_path / "download")
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["format"] for e in manifest["exports"]] == ["gguf", "nnef", "safetensors"]

    prompt = "The capital of France is"
    hf_tokens, hf_text = hf_greedy(source, prompt, 4)
    # GGUF: llama.cpp's tokenizer and greedy continuation are transformers'.
    (gguf_file,) = (out / "gguf").glob("*.gguf")
    tok = AutoTokenizer.from_pretrained(source)
    for label, text in PROBES.items():
        assert llama_tokenize(gguf_file, text, tmp_path) == tok(
            text, add_special_tokens=False
        ).input_ids, label
    assert_same_continuation(llama_greedy(gguf_file, prompt, 4), hf_text)

    # NNEF: the downloaded archive, run by tract here, decodes the prompt like transformers.
    io_spec = json.loads((out / "nnef" / "io.json").read_text())
    ids = tok(prompt).input_ids
    request = {
        "prompt": np.asarray([ids], dtype=np.int64),
        "tokens": np.asarray(hf_tokens, dtype=np.int64),
        "cache_shapes": np.asarray(
            [[0 if d == "P" else int(d) for d in t["shape"]] for t in io_spec["inputs"][1:]]
        ),
        "cache_dtypes": np.asarray([t["dtype"] for t in io_spec["inputs"][1:]]),
    }
    logits, _ = run_decode(load_runnable(out / "nnef" / "model.nnef.tgz"), request)
    assert [int(np.argmax(step)) for step in logits] == hf_tokens

    # safetensors: transformers reloads it, same logits as the source, still tied.
    x = torch.tensor([ids])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(x).logits
        model = AutoModelForCausalLM.from_pretrained(out / "safetensors", dtype=torch.float32)
        assert torch.equal(model(x).logits, want)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_config_promising_4000_layers_is_refused_at_submission_naming_the_key(
    service: ServiceProcess, root: Path
) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": (root / "4000-layers").as_uri(), "exports": [{"format": "gguf"}]})  # fmt: skip
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body = response.json()
    assert body["type"].endswith("config_mismatch")
    assert "num_hidden_layers is 4000, but the weights hold 2 layer(s)" in body["detail"]


def test_an_architecture_nnef_does_not_support_is_refused_at_submission_with_the_list(
    service: ServiceProcess, root: Path
) -> None:
    with service.client() as client:
        response = client.post("/v1/jobs", json={
            "source": (root / "gpt2").as_uri(), "exports": [{"format": "nnef"}]})  # fmt: skip
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["type"].endswith("unsupported_export")
    assert "causal LM type 'gpt2'" in body["detail"] and "llama" in body["detail"]


@pytest.mark.parametrize(
    "export",
    [
        {"format": "gguf", "type": "Q4_K_M"},
        {"format": "gguf", "type": "Q4_K_M", "verify": False,
         "imatrix": {"calibration": "builtin"}},
    ],
)  # fmt: skip
def test_an_encoder_is_not_run_as_a_causal_lm_in_llama_cpp(
    service: ServiceProcess, root: Path, export: dict[str, object]
) -> None:
    """Real all-MiniLM (BertModel): a K-quant's perplexity check and an importance matrix need
    next-token logits, which llama.cpp does not compute for an encoder (llama-perplexity
    aborted after the export: verification_failed with a backtrace). Refused at submission,
    with what to take instead; the same Q4_K_M unverified is accepted."""
    with service.client() as client:
        response = client.post(
            "/v1/jobs", json={"source": (root / "minilm").as_uri(), "exports": [export]}
        )
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["type"].endswith("unsupported_export"), body
        assert "BertModel is an encoder" in body["detail"] and "q8_0" in body["detail"]
        unverified = {"format": "gguf", "type": "Q4_K_M", "verify": False}
        plan = client.post("/v1/jobs", json={
            "source": (root / "minilm").as_uri(), "exports": [unverified], "dry_run": True})  # fmt: skip
    assert plan.status_code == 200, plan.text


def test_a_hidden_size_the_bin_weights_lack_fails_the_job_typed_with_no_artifacts(
    service: ServiceProcess, root: Path
) -> None:
    """.bin shards have no header the API reads, so the job finds out, at READ, in a second.
    (Safetensors alone: GGUF's own submission check already refuses 65536 over 9 heads.)"""
    job = submit(service, {"source": (root / "wide-bin").as_uri(),
                           "exports": [{"format": "safetensors"}]})  # fmt: skip
    done = service.wait_for(job["id"], timeout=300)
    assert done["status"] == "failed"
    assert done["error"]["type"] == "config_mismatch", done["error"]
    assert "hidden_size is 65536" in done["error"]["message"]
    assert done["artifacts"] == []
    shutil.rmtree(root / "wide-bin")  # nothing else uses it
