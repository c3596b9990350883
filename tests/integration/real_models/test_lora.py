"""A PEFT LoRA adapter on real SmolLM2 (its first 2 layers), merged while the weights stream.

The adapter is PEFT's own (``tests/fixtures/lora.py``: non-zero factors, so the merged model
differs from the base); the judge is PEFT's ``merge_and_unload``: each merged weight the reader
serves, and a safetensors export made by a real job (offload, transformers+PEFT as the job's
independent reference, the exporter's own check) that transformers reloads.
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
from service.checkpoint import open_checkpoint
from service.checkpoint.lora import LoraMergeReader, open_adapter
from service.config import Settings
from service.exporters.gguf.llama_check import PPL_CTX, PPL_TEXT
from service.jobs.layout import JobLayout
from service.jobs.pipeline import _identify, run_pipeline
from service.jobs.spec import JobSpec
from service.sources import SourceRequest
from service.stage import InMemoryContext
from service.verification.llama_kl import write_llama_base_logits
from service.verification.logits import LogitBounds, chunk_tokens
from tests.fixtures.lora import peft_adapter, peft_merged
from tests.fixtures.real_models import Variant, real_variant
from tests.integration.real_models.test_quantized import (
    FloatReference,
    assert_within,
    llama_figures,
)

LAYERS = 2
PROMPT = "The capital of France is"
MERGED_GGUF_BOUNDS = LogitBounds(kl_mean=0.002, kl_p99=0.02, top1=0.97, ppl_ratio=1.05)
"""f16 GGUF of the merged model against PEFT's merged model in float32: only f16 and bfloat16
rounding separate them (the bounds of an unquantized export in test_quantized.py)."""


@pytest.fixture(scope="module")
def base() -> Path:
    return real_variant("smollm2", Variant(layers=LAYERS))


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``plain`` (r 8, alpha 16) and ``patterned`` (rsLoRA, a rank and an alpha pattern),
    beside each other (the job's local root)."""
    root = tmp_path_factory.mktemp("adapters")
    peft_adapter(base, root / "plain")
    peft_adapter(base, root / "patterned", seed=1, use_rslora=True,
                 rank_pattern={"down_proj": 4}, alpha_pattern={"v_proj": 32})  # fmt: skip
    return root


@pytest.mark.parametrize("name", ["plain", "patterned"])
def test_each_merged_weight_equals_peft_merge_and_unload(
    base: Path, adapters: Path, name: str
) -> None:
    theirs = peft_merged(base, adapters / name, torch.bfloat16).state_dict()
    with open_checkpoint(base) as checkpoint:
        reader = LoraMergeReader(checkpoint.reader, open_adapter(adapters / name))
        assert len(reader.adapter.factors) == 4 * LAYERS
        for weight in reader.adapter.factors:
            ours = reader.read(weight)
            assert ours.dtype == theirs[weight].dtype == torch.bfloat16
            # bfloat16 on both sides: at most one rounding step apart (PEFT rounds the delta).
            torch.testing.assert_close(ours, theirs[weight], rtol=2**-7, atol=1e-6)
            moved = (ours.float() - checkpoint.reader.read(weight).float()).abs().max()
            assert moved > 0.01, f"{weight}: the adapter did not change it"
            # The streamed paths the writers use serve the same merged rows.
            assert torch.equal(
                torch.cat(list(reader.iter_chunks(weight, 40_000))), ours.reshape(-1)
            )
            part = torch.empty(777, dtype=torch.bfloat16)
            reader.read_into(weight, 1001, part)
            assert torch.equal(part, ours.reshape(-1)[1001:1778])
        untouched = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(reader.read(untouched), checkpoint.reader.read(untouched))


@pytest.fixture(scope="module")
def merged_job(base: Path, adapters: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real job (offload, PEFT as the independent reference, each exporter's own check) of
    the base with the ``patterned`` adapter, as safetensors and f16 GGUF; its artifacts."""
    tmp = tmp_path_factory.mktemp("merged-job")
    settings = Settings(data_dir=tmp / "data", local_roots=[base.parent, adapters])
    layout = JobLayout.for_job(settings, "a" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="a" * 32)
    spec = JobSpec.model_validate({
        "source": base.as_uri(), "adapter": (adapters / "patterned").as_uri(),
        "exports": [{"format": "safetensors"}, {"format": "gguf", "type": "f16"}],
    })  # fmt: skip
    run_pipeline(spec, ctx, layout)
    return layout.artifacts


def test_the_merged_job_records_the_adapter_and_peft_agrees_with_its_model(
    merged_job: Path, adapters: Path
) -> None:
    manifest = json.loads((merged_job / "manifest.json").read_text())
    assert manifest["source"]["adapter"]["uri"] == (adapters / "patterned").as_uri()
    assert manifest["model"]["reference"]["job_model_agreement"]["passed"]
    assert not (merged_job / "safetensors" / "adapter_config.json").exists()


def test_a_safetensors_export_of_a_merged_job_reloads_with_peft_merged_logits(
    base: Path, adapters: Path, merged_job: Path
) -> None:
    ids = AutoTokenizer.from_pretrained(base)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = peft_merged(base, adapters / "patterned", torch.bfloat16).float()(ids).logits
        exported = AutoModelForCausalLM.from_pretrained(
            merged_job / "safetensors", dtype=torch.float32
        )
        got = exported(ids).logits
        unmerged = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(ids).logits
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 1e-2
    assert (unmerged - want).abs().max() / scale > 0.1, "the adapter changes nothing visible"


def _reference(model: Any, chunks: np.ndarray, out: Path) -> FloatReference:
    with torch.no_grad():
        logits = [
            model(torch.from_numpy(c[None].astype(np.int64))).logits[0].numpy() for c in chunks
        ]
    write_llama_base_logits(out, chunks, int(model.config.vocab_size), logits)
    return FloatReference(chunks, logits, out)


def test_llama_cpp_runs_the_merged_gguf_like_peft_merged_model(
    base: Path, adapters: Path, merged_job: Path, tmp_path: Path
) -> None:
    ids = AutoTokenizer.from_pretrained(base)(PPL_TEXT, add_special_tokens=False)["input_ids"]
    chunks = chunk_tokens(ids, PPL_CTX)  # SmolLM2's GGUF adds no BOS
    merged = _reference(peft_merged(base, adapters / "patterned"), chunks, tmp_path / "m.logits")
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    unmerged = _reference(plain, chunks, tmp_path / "u.logits")
    gguf = next((merged_job / "gguf").glob("*.gguf"))
    against_peft, against_base = llama_figures(gguf, merged), llama_figures(gguf, unmerged)
    # 2 layers put perplexity below llama.cpp's floor: its ratio says nothing (test_quantized).
    assert_within(against_peft, MERGED_GGUF_BOUNDS, "merged f16 GGUF against PEFT", ppl=False)
    assert against_base.kl_mean > 10 * against_peft.kl_mean, (against_base, against_peft)


def test_an_adapter_trained_on_another_base_is_refused_at_submission_naming_the_module(
    base: Path, tmp_path: Path
) -> None:
    config = LlamaConfig.from_pretrained(base)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 16})  # fmt: skip
    torch.manual_seed(0)
    other = peft_adapter(LlamaForCausalLM(config), tmp_path / "other-base")
    deeper = tmp_path / "deeper"
    config = LlamaConfig.from_pretrained(base)
    config.update(
        {
            "num_hidden_layers": LAYERS + 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
        }
    )
    peft_adapter(LlamaForCausalLM(config), deeper, target_modules=["layers.2.self_attn.q_proj"])
    settings = Settings(data_dir=tmp_path / "data", local_roots=[base.parent, tmp_path])
    app = create_app(settings)
    app.state.jobs.store.create_schema()
    try:
        client = TestClient(app)
        for adapter, detail in [
            (
                other,
                (
                    "the adapter's 'model.layers.0.mlp.down_proj' is 64x128 (lora_B @ lora_A), "
                    "but the source's 'model.layers.0.mlp.down_proj.weight' is 576x1536"
                ),
            ),
            (
                deeper,
                (
                    "the adapter targets 'model.layers.2.self_attn.q_proj', but the source has "
                    "no tensor 'model.layers.2.self_attn.q_proj.weight'"
                ),
            ),
        ]:
            response = client.post("/v1/jobs", json={
                "source": base.as_uri(), "adapter": adapter.as_uri(),
                "exports": [{"format": "safetensors"}],
            })  # fmt: skip
            assert response.status_code == 422, response.text
            body = response.json()
            assert body["type"].endswith("/adapter_mismatch"), body
            assert detail in body["detail"], body["detail"]
    finally:
        app.state.jobs.store.dispose()


def test_result_reuse_keys_on_the_adapter(base: Path, adapters: Path, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", local_roots=[base.parent, adapters])
    ctx = InMemoryContext(settings=settings, work_dir=tmp_path, job_id="b" * 32)
    source = SourceRequest(base.as_uri())

    def key(adapter: str | None) -> str:
        request = SourceRequest((adapters / adapter).as_uri()) if adapter else None
        identity, _ = _identify(source, request, ctx)
        assert identity is not None
        return identity.key

    plain, patterned, none = key("plain"), key("patterned"), key(None)
    assert len({plain, patterned, none}) == 3
    assert plain == key("plain")
    assert plain.startswith(none + "+adapter:files:")
