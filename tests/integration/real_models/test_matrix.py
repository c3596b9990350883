"""Layout variants of real checkpoints through every exporter that claims them, each artifact
checked by the program that consumes it.

A covering set, not the product: :data:`COVERING_VARIANTS` holds each value of each axis (tie
under the input name / output name / both; transformers-4 ``rope_theta`` / ``rope_scaling`` vs
transformers-5 ``rope_parameters``; float32 / float16 / bfloat16; one file / sharded with an index
/ ``.bin`` shards) at least once, and every variant goes through every exporter, so each exporter
sees each value. Real weights, first 2 layers (SmolLM2: Llama, GQA 9/3, tied; all-MiniLM: BERT,
untied, no rope). One job per variant runs all its exports from one offload store; the tests then
judge one (variant, export) each:

* safetensors: reloaded by transformers, logits equal the source's; the job's own parity passed
* gguf: llama.cpp itself (``llama-tokenize`` ids of the probe set == the HF tokenizer's,
  ``llama-simple`` greedy continuation == transformers')
* nnef: tract decoded like the job's PyTorch, and that decode == transformers' own argmax loop
* onnx: onnxruntime's greedy decode (a fresh session, cache fed back) == transformers'
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from tests.fixtures.real_models import COVERING_VARIANTS, REAL_MODELS, Variant, real_variant
from tests.integration.exporters.test_onnx import _decode_in_ort
from tests.integration.real_models.test_consumers import (
    PROBES,
    assert_same_continuation,
    assert_tract_decoded_like_transformers,
    hf_greedy,
    llama_greedy,
    llama_tokenize,
    run_job,
)

LAYERS = 2
NEW_TOKENS = 4
CASES: list[tuple[str, Variant]] = [
    ("smollm2", replace(v, layers=LAYERS)) for v in COVERING_VARIANTS
] + [
    # an encoder has no tie and no rope: its axes are dtype and layout
    ("minilm", Variant(tie="input", config_keys="v5", dtype="float16", layout="bin-sharded",
                       layers=LAYERS)),
]  # fmt: skip
EXPORTS: dict[str, dict[str, Any]] = {
    "safetensors": {"format": "safetensors"},
    "gguf": {"format": "gguf", "type": "f16"},
    "nnef": {"format": "nnef", "decode_steps": 3},
    "onnx": {"format": "onnx", "decode_steps": 3},
}
CLAIMS = {"llama": ["safetensors", "gguf", "nnef", "onnx"], "bert": ["safetensors", "nnef", "onnx"]}


def _claims(name: str) -> list[str]:
    return CLAIMS[REAL_MODELS[name].family]


class _JobCache(dict[str, tuple[Path, Path, dict[str, Any]]]):
    """label -> (source, artifacts, manifest)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def run(self, name: str, variant: Variant) -> tuple[Path, Path, dict[str, Any]]:
        label = f"{name}-{variant.label()}"
        if label not in self:
            source = real_variant(name, variant)
            exports = [EXPORTS[e] for e in _claims(name)]
            artifacts, manifest = run_job(self.factory.mktemp(label), source, exports)
            self[label] = (source, artifacts, manifest)
        return self[label]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> _JobCache:
    """Each variant's one job (all its exports), run on first use, shared by the module."""
    return _JobCache(tmp_path_factory)


def _cases() -> list[Any]:
    return [
        pytest.param(name, variant, export, id=f"{name}-{variant.label()}-{export}")
        for name, variant in CASES
        for export in _claims(name)
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,variant,export", _cases())
def test_each_layout_variant_exports_and_runs_in_the_real_consumer(
    name: str, variant: Variant, export: str, jobs: _JobCache, tmp_path: Path
) -> None:
    source, artifacts, manifest = jobs.run(name, variant)
    summary = next(e for e in manifest["exports"] if e["format"] == export)
    out = artifacts / summary["dir"]
    decoder = REAL_MODELS[name].decoder
    if export == "safetensors":
        assert summary["verify"]["passed"], summary["verify"]
        _assert_reloads_like_the_source(source, out, decoder)
    elif export == "gguf":
        (gguf_file,) = out.glob("*.gguf")
        tok = AutoTokenizer.from_pretrained(source)
        for label, text in PROBES.items():
            expected = tok(text, add_special_tokens=False).input_ids
            assert llama_tokenize(gguf_file, text, tmp_path) == expected, label
        _, hf_text = hf_greedy(source, "The capital of France is", NEW_TOKENS)
        assert_same_continuation(
            llama_greedy(gguf_file, "The capital of France is", NEW_TOKENS), hf_text
        )
    elif export == "nnef":
        verify = summary["verify"]
        assert verify["max_abs_err"] <= verify["tolerance"], verify
        if decoder:
            assert_tract_decoded_like_transformers(source, verify)
    else:
        verify = summary["verify"]
        assert verify["max_abs_err"] <= verify["tolerance"], verify
        if decoder:
            _assert_ort_decodes_like_transformers(source, out / "model.onnx")


def _assert_reloads_like_the_source(source: Path, out: Path, decoder: bool) -> None:
    """transformers loads the export; its outputs equal the source's (same dtype: bit-equal
    weights, so equal outputs), and a tied model is still tied (a source storing both names
    keeps both, equal)."""
    auto = AutoModelForCausalLM if decoder else AutoModel
    ids = torch.tensor([[11, 400, 1234, 77, 5]])
    with torch.no_grad():
        want = auto.from_pretrained(source, dtype=torch.float32).eval()(input_ids=ids)
        model = auto.from_pretrained(out, dtype=torch.float32).eval()
        got = model(input_ids=ids)
    key = "logits" if decoder else "last_hidden_state"
    assert torch.equal(got[key], want[key])
    config = json.loads((out / "config.json").read_text())
    if decoder and config.get("tie_word_embeddings"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        stored: dict[str, torch.Tensor] = {}
        for f in out.glob("*.safetensors"):
            stored.update(load_file(f))
        copies = [stored[n] for n in ("model.embed_tokens.weight", "lm_head.weight") if n in stored]
        assert copies and all(torch.equal(c, copies[0]) for c in copies)


def _assert_ort_decodes_like_transformers(source: Path, model_path: Path) -> None:
    prompt = [11, 400, 1234, 77]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert _decode_in_ort(model_path, prompt, NEW_TOKENS) == ids[0, len(prompt) :].tolist()


def test_the_matrix_covers_every_value_of_every_axis_for_every_exporter() -> None:
    decoders = [v for name, v in CASES if REAL_MODELS[name].decoder]
    for axis in ("tie", "config_keys", "dtype", "layout"):
        values = {getattr(v, axis) for v in decoders}
        assert values == {getattr(v, axis) for v in COVERING_VARIANTS}, axis
    assert {e for name, _ in CASES for e in _claims(name)} == set(EXPORTS)
    assert np.all([v.layers == LAYERS for _, v in CASES])
