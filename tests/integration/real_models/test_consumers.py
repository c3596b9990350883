"""Real models through the job pipeline, each artifact checked by the program that consumes it.

GGUF is checked by llama.cpp itself (``llama-tokenize``, ``llama-simple``) on the f16
export of SmolLM2 (Llama), Gemma 3 and Qwen2.5's first layers (more families:
test_gguf_architectures.py): the ids of a fixed probe set equal the Hugging Face tokenizer's, the
greedy continuation equals transformers' on the source checkpoint. The helpers here (tract's decode against
transformers' argmax loop...) are shared with ``bench/real_models.py``, which runs every model x
layout x export. A missing llama.cpp tool raises ``ToolMissing``: the test fails, never skips.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.config import Settings
from service.errors import VerificationFailed
from service.exporters.nnef.verify import IOSpec, verify_causal_lm
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.shims.llama_cpp import llama_cpp_tool
from service.stage import InMemoryContext
from service.verification.reference import prompt_ids
from tests.fixtures.real_models import REAL_MODELS, Variant, real_model, real_variant
from tests.integration.exporters.test_nnef import _reference, scale_weight

PROBES = {
    "ascii": "The quick brown fox jumps over the lazy dog. It was 3:45pm, 12% done.",
    "code": 'def add(a, b):\n    """Sum."""\n    if a:\n        return a + b\n    return b\n',
    "whitespace": "a  b   c\t\td \t e\n\n\n  f",
    "accents-cjk": "Café naïve résumé Ærøskøbing — 東京は日本の首都です。北京欢迎你",
    "emoji": "Deploy 🚀 done ✅ 👩‍💻 🇫🇷",
}
PROMPT = "The capital of France is"
NEW_TOKENS = 8


def run_job(tmp_path: Path, source: Path, exports: list[dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """One job through ``run_pipeline`` (real offload, real exporters, their own checks)."""
    settings = Settings(data_dir=tmp_path / "data", local_roots=[source.parent])
    job_id = "e" * 32
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
    spec = JobSpec.model_validate({"source": f"file://{source}", "exports": exports})
    run_pipeline(spec, ctx, layout)
    return layout.artifacts, json.loads((layout.artifacts / "manifest.json").read_text())


def llama_tokenize(gguf_file: Path, text: str, tmp_path: Path) -> list[int]:
    prompt = tmp_path / "probe.txt"
    prompt.write_text(text, encoding="utf-8")
    out = subprocess.run(
        [str(llama_cpp_tool("llama-tokenize")), "-m", str(gguf_file), "-f", str(prompt),
         "--ids", "--no-bos", "--log-disable", "-t", "2"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=True,
    )
    return [int(t) for t in json.loads(out.stdout.strip().splitlines()[-1])]


def llama_greedy(gguf_file: Path, prompt: str, n: int) -> str:
    """llama.cpp's greedy continuation of ``prompt`` (``n`` tokens), from ``llama-simple``.

    Why not ``llama-completion``: it prints the generated text through llama.cpp's asynchronous
    logger, which on a model this small loses its queued lines at exit about one run in two
    (exit 0, empty stdout; seen on a tiny Phi-3 with the same GGUF giving '' and the text by
    turns). ``llama-simple`` samples greedily and ``printf``s each piece: the prompt's tokens
    rendered (special ones included, e.g. ``<s>``), the continuation, then one newline.
    """
    out = subprocess.run(
        [str(llama_cpp_tool("llama-simple")), "-m", str(gguf_file), "-n", str(n), prompt],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    assert out.stdout.endswith("\n"), out.stdout[-300:]
    echoed = out.stdout[:-1]
    assert prompt in echoed, (prompt, echoed[:300])
    return echoed[echoed.index(prompt) + len(prompt) :]


def hf_greedy(ckpt: Path, prompt: str, n: int) -> tuple[list[int], str]:
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


def assert_tract_decoded_like_transformers(source: Path, verify: dict[str, Any]) -> None:
    """tract's argmax agreed at every step with the job's PyTorch decode, and that decode is
    transformers' own ``generate`` on the job's prompt (an independent reference)."""
    assert verify["argmax_agreed"] and all(verify["argmax_agreed"]), verify
    config = json.loads((source / "config.json").read_text())
    prompt = torch.tensor([prompt_ids(4, int(config["vocab_size"]))])
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = prompt
    with torch.no_grad():  # plain argmax, no generate(): an end-of-text token must not stop it
        for _ in verify["tokens"]:
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, prompt.shape[1] :].tolist() == verify["tokens"]


def assert_same_continuation(llama_text: str, hf_text: str) -> None:
    assert llama_text == hf_text, (llama_text, hf_text)


GGUF_F16_LAYERS = {"smollm2": None, "qwen2": 4, "gemma3": 6}
"""Layers of each real model the GGUF f16 check runs (None: all): SmolLM2 whole (the full depth,
where rounding adds up), Qwen2.5 its first 4 real layers with its whole vocabulary and tokenizer
(every tensor kind the converter maps: GQA 14/2, qkv biases, tied embedding), Gemma 3 its first 6
(five sliding-window layers and the first global one, the pattern every sixth layer repeats; its
262k vocabulary and tokenizer whole). Gemma 3 whole took 157 s of the suite for depth SmolLM2
already covers."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(GGUF_F16_LAYERS))
def test_gguf_f16_of_a_real_model_runs_in_llama_cpp_like_transformers(
    name: str, tmp_path: Path
) -> None:
    layers = GGUF_F16_LAYERS[name]
    source = real_model(name) if layers is None else real_variant(name, Variant(layers=layers))
    artifacts, _ = run_job(tmp_path, source, [{"format": "gguf", "type": "f16"}])
    (gguf_file,) = (artifacts / "gguf").glob("*.gguf")
    tok = AutoTokenizer.from_pretrained(source)
    for label, text in PROBES.items():
        expected = tok(text, add_special_tokens=False).input_ids
        assert llama_tokenize(gguf_file, text, tmp_path) == expected, label
    hf_tokens, _ = hf_greedy(source, PROMPT, NEW_TOKENS)
    # llama-simple prints every token it samples, special ones included, and stops before an
    # end-of-generation token: transformers' tokens are rendered the same way (a model cut to
    # its first layers may sample a special token: Qwen2.5's first 4 layers sample <|fim_middle|>)
    if hf_tokens and hf_tokens[-1] in _eos_ids(source, tok):
        hf_tokens = hf_tokens[:-1]
    hf_text = tok.decode(hf_tokens, skip_special_tokens=False)
    assert_same_continuation(llama_greedy(gguf_file, PROMPT, NEW_TOKENS), hf_text)


def _eos_ids(source: Path, tok: Any) -> set[int]:
    """The ids that end transformers' generate: the tokenizer's and the generation config's."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = source / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


@pytest.mark.parametrize("name", ["minilm"])
def test_safetensors_and_nnef_of_a_real_model_match_transformers_and_tract(
    name: str, tmp_path: Path
) -> None:
    source = real_model(name)
    decoder = REAL_MODELS[name].decoder
    nnef: dict[str, Any] = {"format": "nnef"}
    if decoder:
        nnef["decode_steps"] = 4
    _, manifest = run_job(tmp_path, source, [{"format": "safetensors"}, nnef])
    exports = {e["format"]: e for e in manifest["exports"]}
    assert exports["safetensors"]["verify"]["passed"], exports["safetensors"]
    verify = exports["nnef"]["verify"]
    assert verify["max_abs_err"] <= verify["tolerance"], verify
    if decoder:
        assert_tract_decoded_like_transformers(source, verify)


def test_nnef_of_real_smollm2_decodes_in_tract_like_transformers(tmp_path: Path) -> None:
    """The model issue 11 reported: GQA 9/3, rope theta 1e5 in rope_parameters, tied under the
    output name (first 4 real layers, float16, sharded). Its check once failed by 12.9 because
    torch-to-nnef's cache patch broke the PyTorch reference's cached decode."""
    source = real_variant(
        "smollm2",
        Variant(tie="output", config_keys="v4", dtype="float16", layout="safetensors-sharded", layers=4),
    )
    artifacts, manifest = run_job(tmp_path, source, [{"format": "nnef", "decode_steps": 4}])
    (nnef,) = manifest["exports"]
    assert nnef["verify"]["max_abs_err"] <= nnef["verify"]["tolerance"], nnef["verify"]
    assert_tract_decoded_like_transformers(source, nnef["verify"])

    # The same archive with one weight of layer 2 broken fails the check, which says where.
    archive = artifacts / "nnef" / "model.nnef.tgz"
    io_spec = IOSpec.from_json(json.loads((archive.parent / "io.json").read_text()))
    expected = _reference(source, tmp_path / "offload", steps=2)
    bad = tmp_path / "layer2.nnef.tgz"
    scale_weight(archive, bad, "model.model.layers.2.mlp.down_proj.weight.dat")
    atol, rtol = nnef["verify"]["tolerance"], 0.0
    with pytest.raises(VerificationFailed, match=r"first diverges at model\.layers\.2 on the "
                       r"prompt \(max abs diff [0-9.e+]+, tolerance"):  # fmt: skip
        verify_causal_lm(bad, io_spec, expected, atol, rtol, work=tmp_path / "verify")
