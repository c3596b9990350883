"""Quantized real checkpoints through every format, each artifact's logits judged by its consumer
against the FLOAT model (transformers on the checkpoint the FP8 one was made from).

* Block-scaled FP8 SmolLM2 (``tests/fixtures/quantized.py``: the real model's first layers,
  64x64 blocks) through safetensors, GGUF q8_0 and Q4_K_M, NNEF and ONNX. FP8 costs a little:
  every artifact must be within :data:`FP8_BOUNDS` (Q4_K_M within :data:`FP8_Q4_K_M_BOUNDS`) of
  the float model in KL and top-1, on the fixed text llama.cpp's perplexity check reads. Read as
  raw codes (the bug this pins), the same figures are KL ~10 and top-1 ~0.
* The same SmolLM2 with the stale ``{"quant_method": "gguf"}`` transformers leaves after
  dequantizing a GGUF, through every format: each accepts it alike, each manifest says the
  config was ignored, and each artifact matches the float model as an unquantized one does.

Consumers: transformers reloads the safetensors; ``llama-perplexity --kl-divergence`` reads base
logits written from the float model (``service.verification.logits``); tract and onnxruntime run
each chunk of the text from an empty cache. First 2 layers only, to stay inside CI's budget.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.exporters.gguf.llama_check import PPL_CTX, PPL_TEXT
from service.shims.llama_cpp import llama_cpp_tool
from service.verification.llama_kl import parse_llama_kl, write_llama_base_logits
from service.verification.logits import (
    LogitBounds,
    LogitFigures,
    chunk_tokens,
    compare_logits,
    scored,
)
from tests.fixtures.quantized import real_fp8, real_stale_gguf
from tests.fixtures.real_models import Variant, real_variant
from tests.integration.real_models.test_consumers import run_job

LAYERS = 2
FP8_BOUNDS = LogitBounds(kl_mean=0.01, kl_p99=0.06, top1=0.95, ppl_ratio=1.1)
"""FP8 (64x64 blocks) against float on 2 layers of SmolLM2 measured KL 0.003 mean, 0.016 p99,
top-1 0.988: about 3x headroom, far below what a misread weight gives."""
FP8_Q4_K_M_BOUNDS = LogitBounds(kl_mean=0.15, kl_p99=0.8, top1=0.8, ppl_ratio=1.5)
"""FP8, then llama-quantize's Q4_K_M mixture (4.5 bits a weight) on top."""
STALE_BOUNDS = LogitBounds(kl_mean=0.002, kl_p99=0.02, top1=0.97, ppl_ratio=1.05)
"""The stale-config checkpoint is the float model: only the formats' own rounding (f16 GGUF,
bfloat16 safetensors) separates them."""


@dataclass(frozen=True)
class Job:
    artifacts: Path
    manifest: dict[str, Any]

    def export(self, dirname: str) -> dict[str, Any]:
        return next(e for e in self.manifest["exports"] if e["dir"] == dirname)


@dataclass(frozen=True)
class FloatReference:
    """The float model's logits on the fixed text, and what llama.cpp reads of them."""

    chunks: np.ndarray
    logits: list[np.ndarray]
    base_file: Path


@pytest.fixture(scope="module")
def float_reference(tmp_path_factory: pytest.TempPathFactory) -> FloatReference:
    source = real_variant("smollm2", Variant(layers=LAYERS))
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer(PPL_TEXT, add_special_tokens=False)["input_ids"]
    chunks = chunk_tokens(ids, PPL_CTX)  # SmolLM2's GGUF adds no BOS
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        logits = [model(torch.from_numpy(c[None].astype(np.int64))).logits[0].numpy() for c in chunks]
    base = tmp_path_factory.mktemp("base") / "float.logits"
    write_llama_base_logits(base, chunks, int(model.config.vocab_size), logits)
    return FloatReference(chunks, logits, base)


@pytest.fixture(scope="module")
def fp8_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    exports = [
        {"format": "safetensors"},
        {"format": "gguf", "type": "q8_0"},
        {"format": "gguf", "type": "Q4_K_M"},
        {"format": "nnef", "decode_steps": 3},
        {"format": "onnx", "decode_steps": 3},
    ]
    artifacts, manifest = run_job(tmp_path_factory.mktemp("fp8"), real_fp8("smollm2", LAYERS), exports)
    return Job(artifacts, manifest)


@pytest.fixture(scope="module")
def stale_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    exports = [
        {"format": "safetensors"},
        {"format": "gguf", "type": "f16"},
        {"format": "nnef", "decode_steps": 3},
        {"format": "onnx", "decode_steps": 3},
    ]
    source = real_stale_gguf("smollm2", LAYERS)
    artifacts, manifest = run_job(tmp_path_factory.mktemp("stale"), source, exports)
    return Job(artifacts, manifest)


# --- each consumer's logits on the chunks of the fixed text ----------------------------------


def transformers_logits(directory: Path, chunks: np.ndarray) -> Iterator[np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        for chunk in chunks:
            yield model(torch.from_numpy(chunk[None].astype(np.int64))).logits[0].numpy()


def tract_logits(directory: Path, chunks: np.ndarray) -> Iterator[np.ndarray]:
    """tract gives the last position's logits: the chunk's first half as the prompt, then each
    next token with tract's own caches fed back (the decode the NNEF check runs), placed at the
    positions the figures score."""
    from service.exporters.nnef.tract_cli import load_runnable, run_decode

    io = json.loads((directory / "io.json").read_text())
    runnable = load_runnable(directory / "model.nnef.tgz")
    window = scored(chunks.shape[1])
    for chunk in chunks:
        request = {
            "prompt": np.asarray([chunk[: window.start]], dtype=np.int64),
            "tokens": np.asarray(chunk[window.start : window.stop + 1], dtype=np.int64),
            "cache_shapes": np.asarray(
                [[0 if d == "P" else int(d) for d in t["shape"]] for t in io["inputs"][1:]]
            ),
            "cache_dtypes": np.asarray([t["dtype"] for t in io["inputs"][1:]]),
        }
        found, _ = run_decode(runnable, request)  # positions window.start - 1 .. window.stop - 1
        logits = np.zeros((len(chunk), found.shape[-1]), dtype=np.float32)
        logits[window.start - 1 : window.stop] = found
        yield logits


def ort_logits(directory: Path, chunks: np.ndarray) -> Iterator[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    for chunk in chunks:
        feeds: dict[str, np.ndarray] = {
            name: np.zeros((1, int(i.shape[1]), 0, int(i.shape[3])), dtype=np.float32)
            for name, i in inputs.items() if name.startswith("past_key_values.")
        }  # fmt: skip
        feeds["input_ids"] = np.ascontiguousarray(chunk[None], dtype=np.int64)
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, len(chunk)), dtype=np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(len(chunk), dtype=np.int64)[None]
        (logits,) = session.run(["logits"], feeds)
        yield np.asarray(logits, dtype=np.float32)[0]


def llama_figures(gguf_file: Path, reference: FloatReference) -> LogitFigures:
    window = scored(PPL_CTX)
    positions = len(reference.chunks) * (window.stop - window.start)
    out = subprocess.run(
        [str(llama_cpp_tool("llama-perplexity")), "-m", str(gguf_file),
         "--kl-divergence-base", str(reference.base_file), "--kl-divergence",
         "-c", str(PPL_CTX), "-b", str(PPL_CTX), "-t", "2"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    figures = parse_llama_kl(out.stdout + out.stderr, positions)
    assert figures is not None, out.stdout[-2000:] + out.stderr[-2000:]
    return figures


def consumer_figures(job: Job, dirname: str, reference: FloatReference) -> LogitFigures:
    directory = job.artifacts / dirname
    fmt = job.export(dirname)["format"]
    if fmt == "gguf":
        return llama_figures(next(directory.glob("*.gguf")), reference)
    logits = {"safetensors": transformers_logits, "nnef": tract_logits, "onnx": ort_logits}[fmt]
    return compare_logits(reference.logits, logits(directory, reference.chunks), reference.chunks)


def assert_within(figures: LogitFigures, bounds: LogitBounds, what: str, ppl: bool = True) -> None:
    """``ppl=False`` for llama.cpp's ratio on a truncated model: its base file floors every
    log-probability at max - 16 nats, and 2 layers of SmolLM2 put most of the text's real next
    tokens below that floor (perplexity ~1e5), so its ratio says nothing there."""
    failed = bounds.violations(figures)
    if not ppl:
        failed = [f for f in failed if not f.startswith("perplexity")]
    assert not failed, f"{what}: {'; '.join(failed)} ({figures})"


# --- FP8 -------------------------------------------------------------------------------------

FP8_DIRS = ["safetensors", "gguf", "gguf-2", "nnef", "onnx"]


def test_the_fp8_job_records_the_dequantization(fp8_job: Job) -> None:
    quantization = fp8_job.manifest["model"]["quantization"]
    assert quantization["method"] == "fp8" and quantization["handling"] == "dequantize"
    assert quantization["dequantized_tensors"] == 7 * LAYERS
    names = [f["path"] for f in fp8_job.manifest["files"]]
    assert not [n for n in names if "scale" in n]


def test_the_fp8_safetensors_export_holds_float_weights_and_no_scale(fp8_job: Job) -> None:
    from safetensors import safe_open

    directory = fp8_job.artifacts / "safetensors"
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.endswith("_scale_inv")]  # noqa: SIM118 - safe_open is no dict
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q_proj.dtype == torch.bfloat16 and q_proj.abs().max() < 20  # raw FP8 codes reach 448


@pytest.mark.parametrize("dirname", FP8_DIRS)
def test_each_fp8_artifact_runs_in_its_consumer_like_the_float_model(
    fp8_job: Job, float_reference: FloatReference, dirname: str
) -> None:
    spec = fp8_job.export(dirname)["spec"]
    figures = consumer_figures(fp8_job, dirname, float_reference)
    bounds = FP8_Q4_K_M_BOUNDS if spec.get("type") == "Q4_K_M" else FP8_BOUNDS
    assert_within(figures, bounds, f"FP8 SmolLM2 as {dirname} {spec}", ppl=spec["format"] != "gguf")


@pytest.mark.parametrize("dirname", ["gguf", "gguf-2"])
def test_the_gguf_logits_check_reports_llama_cpps_peak_memory(fp8_job: Job, dirname: str) -> None:
    """Each child's peak is in the manifest: llama-perplexity's too, which maps the whole file,
    so that its RSS holds the file's pages; its anonymous peak, beside it, does not."""
    logits = fp8_job.export(dirname)["verify"]["logits"]
    gguf_bytes = next((fp8_job.artifacts / dirname).glob("*.gguf")).stat().st_size
    assert 0 < gguf_bytes < logits["llama_cpp_peak_rss_bytes"], logits
    anon = logits["llama_cpp_peak_anon_bytes"]
    assert anon is not None and 0 < anon < logits["llama_cpp_peak_rss_bytes"] - gguf_bytes // 2, logits


@pytest.mark.parametrize("dirname", ["nnef", "onnx"])
def test_nnef_and_onnx_report_their_runtimes_logit_figures_in_the_manifest(
    fp8_job: Job, dirname: str
) -> None:
    """The job's own check: tract's and onnxruntime's logits on the fixed text against
    transformers' run of the source, the figures GGUF's llama.cpp check reports, within the
    bounds the job judged them by."""
    logits = fp8_job.export(dirname)["verify"]["logits"]
    assert logits["reference"].startswith("transformers.")
    assert logits["positions"] == 126 and logits["bounds"] is not None
    bounds = LogitBounds(**logits["bounds"])
    figures = LogitFigures(**{k: logits[k] for k in ("kl_mean", "kl_p99", "top1", "ppl_ratio", "positions")})
    assert bounds.violations(figures) == []
    assert figures.kl_mean < FP8_BOUNDS.kl_mean and figures.top1 >= FP8_BOUNDS.top1


# --- the stale GGUF quantization_config ---------------------------------------------------------

STALE_DIRS = ["safetensors", "gguf", "nnef", "onnx"]


def test_every_format_ignores_the_stale_config_alike_and_says_so(stale_job: Job) -> None:
    quantization = stale_job.manifest["model"]["quantization"]
    assert quantization["method"] == "gguf" and quantization["handling"] == "ignored"
    assert "contradict" in quantization["reason"]
    assert sorted(e["dir"] for e in stale_job.manifest["exports"]) == sorted(STALE_DIRS)
    for dirname in STALE_DIRS:  # the config each carries says float, like its weights
        if dirname != "gguf":
            config = json.loads((stale_job.artifacts / dirname / "config.json").read_text())
            assert "quantization_config" not in config, dirname


@pytest.mark.parametrize("dirname", STALE_DIRS)
def test_each_artifact_of_the_stale_config_checkpoint_runs_like_the_float_model(
    stale_job: Job, float_reference: FloatReference, dirname: str
) -> None:
    fmt = stale_job.export(dirname)["format"]
    figures = consumer_figures(stale_job, dirname, float_reference)
    assert_within(figures, STALE_BOUNDS, f"stale-config SmolLM2 as {dirname}", ppl=fmt != "gguf")
