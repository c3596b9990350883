"""A PEFT LoRA adapter kept apart (``"merge": false``) and written as a GGUF LoRA beside the base
GGUF, on real SmolLM2 (its first 2 layers): llama.cpp runs the base with ``--lora`` and must
compute what PEFT computes with the adapter (``PeftModel``, unmerged).

The adapter is ``patterned`` (rsLoRA, a rank and an alpha pattern): llama.cpp scales each pair
by ``alpha / r`` only, so this is the adapter whose scale the export must fold into ``B``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from service.api.app import create_app
from service.config import Settings
from service.exporters.gguf.directory import read_directory
from service.exporters.gguf.llama_check import CALIBRATED_FIGURES, PPL_CTX, PPL_TEXT
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
from service.verification.llama_kl import write_llama_base_logits
from service.verification.logits import chunk_tokens
from tests.fixtures.lora import peft_adapter
from tests.fixtures.real_models import Variant, real_variant
from tests.integration.real_models.test_quantized import FloatReference, llama_figures

LAYERS = 2


@pytest.fixture(scope="module")
def base() -> Path:
    return real_variant("smollm2", Variant(layers=LAYERS))


@pytest.fixture(scope="module")
def adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    return peft_adapter(base, root / "patterned", seed=1, use_rslora=True,
                        rank_pattern={"down_proj": 4}, alpha_pattern={"v_proj": 32})  # fmt: skip


@pytest.fixture(scope="module")
def lora_job(base: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real job: the base as f16 GGUF plus the adapter as a GGUF LoRA, each checked by
    llama.cpp (the LoRA with ``--lora`` against PEFT); its artifacts."""
    tmp = tmp_path_factory.mktemp("lora-job")
    settings = Settings(data_dir=tmp / "data", local_roots=[base.parent, adapter.parent])
    layout = JobLayout.for_job(settings, "d" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="d" * 32)
    spec = JobSpec.model_validate({
        "source": base.as_uri(), "adapter": adapter.as_uri(), "merge": False,
        "exports": [{"format": "gguf", "type": "f16", "lora": True}],
    })  # fmt: skip
    run_pipeline(spec, ctx, layout)
    return layout.artifacts


def test_the_job_writes_the_base_and_a_gguf_lora_that_llama_cpp_runs_like_peft(
    lora_job: Path,
) -> None:
    manifest = json.loads((lora_job / "manifest.json").read_text())
    export = manifest["exports"][0]
    assert sorted(p.name for p in (lora_job / "gguf").iterdir()) == [
        "lora-f16.gguf", "model-f16.gguf",
    ]  # fmt: skip
    assert {f["path"] for f in manifest["files"]} >= {"gguf/lora-f16.gguf", "gguf/model-f16.gguf"}
    lora = export["lora"]
    assert lora["modules"] == 4 * LAYERS and lora["tensors"] == 8 * LAYERS
    # rsLoRA: PEFT scales alpha/sqrt(r), llama.cpp alpha/r, so B carries sqrt(r) (sqrt(8), and
    # sqrt(4) on down_proj whose rank_pattern is 4).
    folded = lora["scale_folded_into_b"]
    assert folded["model.layers.0.self_attn.q_proj"] == pytest.approx(8**0.5)
    assert folded["model.layers.0.mlp.down_proj"] == pytest.approx(4**0.5)
    checked = export["verify"]["lora_logits"]
    assert checked["reference"].endswith("+ peft.PeftModel") and checked["lora"] == "lora-f16.gguf"
    bounds = CALIBRATED_FIGURES["f16"]
    assert checked["kl_mean"] <= bounds.kl_mean and checked["top1"] >= bounds.top1, checked
    assert manifest["source"]["adapter"]["uri"].endswith("/patterned")


def test_the_gguf_lora_holds_llama_cpps_adapter_keys_and_pairs(lora_job: Path) -> None:
    directory = read_directory(lora_job / "gguf" / "lora-f16.gguf")
    meta = directory.metadata
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["adapter.lora.alpha"] == 16.0
    shapes = {t.name: t.shape for t in directory.tensors}
    assert shapes["blk.0.attn_q.weight.lora_a"] == (8, 576)
    assert shapes["blk.0.attn_q.weight.lora_b"] == (576, 8)
    assert shapes["blk.1.ffn_down.weight.lora_a"] == (4, 1536)


def _reference(model: Any, chunks: np.ndarray, out: Path) -> FloatReference:
    with torch.no_grad():
        logits = [
            model(torch.from_numpy(c[None].astype(np.int64))).logits[0].numpy() for c in chunks
        ]
    write_llama_base_logits(out, chunks, int(model.config.vocab_size), logits)
    return FloatReference(chunks, logits, out)


def test_without_the_lora_llama_cpp_is_far_from_peft(
    base: Path, adapter: Path, lora_job: Path, tmp_path: Path
) -> None:
    """The check has teeth: the base GGUF alone (no ``--lora``) is far from PEFT's run."""
    from peft import PeftModel

    ids = AutoTokenizer.from_pretrained(base)(PPL_TEXT, add_special_tokens=False)["input_ids"]
    chunks = chunk_tokens(ids, PPL_CTX)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(plain, str(adapter)).eval()
    reference = _reference(peft, chunks, tmp_path / "peft.logits")
    alone = llama_figures(lora_job / "gguf" / "model-f16.gguf", reference)
    manifest = json.loads((lora_job / "manifest.json").read_text())
    with_lora = manifest["exports"][0]["verify"]["lora_logits"]["kl_mean"]
    assert alone.kl_mean > 100 * max(with_lora, 1e-6), (alone, with_lora)


@pytest.fixture(scope="module")
def client(base: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("api")
    config = LlamaConfig.from_pretrained(base)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 16})  # fmt: skip
    torch.manual_seed(0)
    peft_adapter(LlamaForCausalLM(config), tmp / "other-base")
    settings = Settings(data_dir=tmp / "data", local_roots=[base.parent, adapter.parent, tmp])
    app = create_app(settings)
    app.state.jobs.store.create_schema()
    try:
        yield TestClient(app), tmp / "other-base"
    finally:
        app.state.jobs.store.dispose()


@pytest.mark.parametrize(
    ("exports", "merge", "problem", "detail"),
    [
        ([{"format": "safetensors"}], False, "unmerged_adapter_unsupported",
         "exports[0] (safetensors) cannot take an unmerged adapter"),
        ([{"format": "gguf", "lora": True}, {"format": "gguf"}], False,
         "unmerged_adapter_unsupported", "exports[1] (gguf) cannot take an unmerged adapter"),
        ([{"format": "gguf", "lora": True}], True, "invalid_request",
         'needs "adapter" and "merge": false'),
    ],
)  # fmt: skip
def test_merge_false_is_refused_at_submission_by_exports_that_cannot_take_it(
    client: Any, base: Path, adapter: Path, exports: list[Any], merge: bool, problem: str,
    detail: str,
) -> None:
    api, _ = client
    response = api.post("/v1/jobs", json={
        "source": base.as_uri(), "adapter": adapter.as_uri(), "merge": merge, "exports": exports,
    })  # fmt: skip
    assert response.status_code == 422, response.text
    assert response.json()["type"].endswith(f"/{problem}"), response.json()
    assert detail in response.json()["detail"]


def test_an_unmerged_adapter_of_another_base_is_refused_at_submission(
    client: Any, base: Path
) -> None:
    api, other = client
    response = api.post("/v1/jobs", json={
        "source": base.as_uri(), "adapter": other.as_uri(), "merge": False,
        "exports": [{"format": "gguf", "lora": True}],
    })  # fmt: skip
    assert response.status_code == 422, response.text
    assert response.json()["type"].endswith("/adapter_mismatch")
    assert "'model.layers.0.mlp.down_proj' is 64x128" in response.json()["detail"]
