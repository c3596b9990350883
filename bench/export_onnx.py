"""Benchmark: a modelprep ONNX job against optimum's ONNX export, side by side in one run.

    .venv/bin/python bench/export_onnx.py [--layers 3,18] [--repeat 3] [--dir /var/tmp]
                                          [--optimum-venv ~/.cache/modelprep/bench-venvs/optimum-onnx]
                                          [--json bench-export-onnx.json]
    .venv/bin/python bench/export_onnx.py --builder   # int4 beside onnxruntime-genai's builder

For each size, a synthetic TinyLlama-shaped float32 checkpoint (``bench/synth_checkpoint.py``:
hidden 2048, intermediate 5632, vocab 32000; 3 layers = 1.1 GB, 18 layers = 4.2 GB; the largest
tensor, the 262 MB embedding, is the same at both sizes) with a small word-level tokenizer. Then,
each in its own child process, one after the other in every round (so a machine whose speed
drifts slows all three alike):

* ``ours``: a whole job (``service.jobs.pipeline.run_pipeline`` on the local checkpoint) with one
  ``{"format": "onnx"}`` export and ``"verify": false``: read the checkpoint into the job's
  offload store, capture the graph on meta, write ``model.onnx`` + ``model.onnx_data``;
* ``ours_verify``: the same with ``"verify": true``: also transformers' independent reference
  on the fixed text and our model's agreement with it, then onnxruntime (a child of the job)
  decoding against PyTorch's greedy tokens and its logits on the fixed text against
  transformers'. The profile of both comes from the job's phase timeline and the time spent in
  each of :data:`PROFILED`, plus onnxruntime's own load and run seconds from its manifest entry;
* ``optimum``: optimum-onnx's ``main_export`` (what ``optimum-cli export onnx --task
  text-generation-with-past`` calls, with the CLI's defaults) with ``do_validation=False``: the
  CLI has no switch for it, and users turn it off because it runs out of memory (optimum
  #1012). It loads the model with ``from_pretrained``, traces it with real weights and saves.
  optimum-onnx pins a transformers our service does not run (4.57 vs 5.x), so it lives in a venv
  of its own (``--optimum-venv``, never committed): ``python -m venv`` there, then the CPU torch
  wheel of ``constraints.txt``, then ``pip install "optimum-onnx[onnxruntime]"``.

Wall time is measured by this script around each child (interpreter start and imports included
for all three); peak RSS is the child's own (:mod:`bench.measure`). Before every run the
checkpoint is read once so each starts with it in the page cache. The first round also runs
optimum's model in the exporter's own onnxruntime decode on the tokens of our verified job:
``tokens_agreed`` says whether its argmax matched at every step, ``max_logit_diff`` how far its
logits are from ours.

The table gives each wall's minimum and median, the ratio of the medians and the median of the
per-round ratios; the load average is recorded before and after each size (the figures are only
as good as the machine was quiet).

On a quiet host (2026-11-27, load 1.1-1.4, nothing else running; ``--layers 3,18 --repeat 3``),
min / median, ratio of the medians to optimum's:

=============  ===================  ====================  =====================  ==================
checkpoint     optimum, no valid.   ours verify off       ours verify on         peak RSS opt/off/on
=============  ===================  ====================  =====================  ==================
1.1 GB, 3 l    33.1 / 36.2 s        23.5 / 27.4 s (0.76)  31.8 / 32.3 s (0.89)   4.75 / 0.61 / 0.99
4.2 GB, 18 l   98.7 / 106.8 s       44.8 / 53.8 s (0.50)  67.9 / 69.5 s (0.65)   8.71 / 0.62 / 3.89
=============  ===================  ====================  =====================  ==================

(GiB; the verified job's peak is transformers' reference loaded whole: no budget is set here.)
Profile of a verified 4.2 GB job (69.5 s): read 3.0, independent reference 5.2, agreement 1.6,
capture 8.0, write 22.8, greedy reference 10.0, onnxruntime decode 1.5 and fixed text 5.2,
finalize 5.0 (``docs/exports.md``, ONNX).

Figures of 2026-11-25, 2 cores shared with other work (load 6-18: indicative only). Before the
two-layer capture (main at 16a69f7), 1.1 GB, two rounds of the three before it was stopped:

==================  ===============  ===============  ===============
round (load)        ours verify off  ours verify on   optimum, no validation
==================  ===============  ===============  ===============
0 (6.6-16)          508 s            558 s            251 s
1 (13-17)           168 s            265 s            (stopped)
==================  ===============  ===============  ===============

Profile of round 1, verify on (seconds): read 16.9, offload 32.6 (transformers' independent
reference 14.6, ours 6.0), capture 104.7, write 34.3, PyTorch's greedy reference 22.9,
onnxruntime decode 4.9 (load 0.6, run 2.5), onnxruntime on the fixed text 13.8 (load 0.7, run
11.1). Capture was the largest phase in every run. Capture alone on meta (``capture_graph``,
TinyLlama shape, one process after a warm-up, load 13-15): every layer traced, 4 layers 137 s,
8 layers 297 s; two traced and the rest stamped, 4 layers 90 s, 8 layers 85 s, 16 layers 69 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1024**3
HIDDEN, INTER, VOCAB = 2048, 5632, 32000
DEFAULT_OPTIMUM_VENV = Path.home() / ".cache" / "modelprep" / "bench-venvs" / "optimum-onnx"

PROFILED = {
    "service.verification.independent": ["independent_reference"],
    "service.offload.dispatch": ["dispatch_model"],
    "service.jobs.pipeline": ["_reference", "_check_agreement"],
    "service.exporters.onnx.exporter": ["capture_graph", "attach_weights", "_save"],
    "service.exporters.onnx.verify": ["greedy_reference", "run_ort", "check_logits"],
}
"""Functions whose wall time the child records (by wrapping them in its own process only)."""


def child_ours(
    ckpt: Path, out: Path, verify: bool, exports: list[dict[str, Any]] | None = None
) -> None:
    """One job exporting ``ckpt`` to ONNX, as the worker runs it; prints its export summary,
    its phase timeline and the time spent in each of :data:`PROFILED`, as JSON."""

    from bench.measure import time_calls
    from service.config import Settings
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    steps = time_calls(PROFILED)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(data_dir=out / ".var", local_roots=[ckpt.parent])
    job_id = "c" * 32
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
    exports = exports or [{"format": "onnx", "decode_steps": 2}]
    spec = JobSpec.model_validate(
        {"source": f"file://{ckpt}", "verify": verify, "exports": exports}
    )
    run_pipeline(spec, ctx, layout)
    ctx.close_phase()
    summary = json.loads((layout.artifacts / "manifest.json").read_text())["exports"][0]
    model_dir = out / "model"
    os.replace(layout.artifacts / summary["dir"], model_dir)  # out of the job's data directory
    shutil.rmtree(out / ".var", ignore_errors=True)
    verified = summary.get("verify") or {}
    print(json.dumps({
        "model": str(model_dir / "model.onnx"), "data_bytes": summary["data_bytes"],
        "export_phase_seconds": summary["phase_seconds"],
        "phases": [(p.phase.value, p.seconds) for p in ctx.phases], "steps": steps,
        "verify": {k: verified.get(k) for k in (
            "max_abs_err", "tolerance", "tokens", "argmax_agreed", "ort_peak_rss_bytes",
            "ort_load_seconds", "ort_run_seconds")} if verified else None,
        "logits": {k: (verified.get("logits") or {}).get(k) for k in (
            "kl_mean", "top1", "ort_load_seconds", "ort_run_seconds")} if verified else None,
        "quality": verified.get("quality"),
    }))  # fmt: skip


def run_measured(argv: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv``; its wall time and its own peak RSS (:mod:`bench.measure`)."""
    from bench.measure import run_measured as measure

    result = measure(argv, log, cwd=ROOT, env=env)
    if result.pop("exit") != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{argv[:3]} failed:\n{tail}")
    return result


def warm(ckpt: Path) -> None:
    """Read every weight file once, so each run starts with the checkpoint in the page cache."""
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as src:
            while src.read(64 << 20):
                pass


def ours(ckpt: Path, work: Path, verify: bool) -> dict[str, Any]:
    out = work / f"ours-{'v' if verify else 'nv'}"
    log = work / f"{out.name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    argv = [sys.executable, __file__, "--child", str(ckpt), str(out), str(int(verify))]
    result = run_measured(argv, log, env)
    result.update(json.loads(log.read_text().strip().splitlines()[-1]))
    return result


OPTIMUM_EXPORT = (
    "import sys\n"
    "from optimum.exporters.onnx import main_export\n"
    "main_export(model_name_or_path=sys.argv[1], output=sys.argv[2],\n"
    "            task='text-generation-with-past', do_validation=False)\n"
)
"""optimum-cli export onnx's call (its other arguments at the CLI's defaults), validation off."""


def optimum(ckpt: Path, work: Path, venv: Path) -> dict[str, Any]:
    out = work / "optimum"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH="")
    argv = [str(venv / "bin" / "python"), "-c", OPTIMUM_EXPORT, str(ckpt), str(out)]
    result = run_measured(argv, work / "optimum.log", env)
    result["model"] = str(out / "model.onnx")
    return result


def decode(model: Path, prompt: list[int], tokens: list[int], work: Path) -> np.ndarray:
    """The exporter's own onnxruntime decode (a child process) on ``model``."""
    from service.exporters.onnx.verify import run_ort

    request = {"prompt": np.asarray([prompt], np.int64), "tokens": np.asarray(tokens, np.int64)}
    logits: np.ndarray = run_ort(model, "decode", request, work).outputs["logits"]
    return logits


def compare(theirs: dict[str, Any], mine: dict[str, Any], work: Path) -> dict[str, Any]:
    """optimum's model and ours decoding our verified job's tokens in onnxruntime."""
    from service.verification.reference import prompt_ids

    tokens = mine["verify"]["tokens"]
    prompt = prompt_ids(4, VOCAB)
    a = decode(Path(theirs["model"]), prompt, tokens, work / "verify-optimum")
    b = decode(Path(mine["model"]), prompt, tokens, work / "verify-ours")
    return {"tokens_agreed": [int(np.argmax(r)) for r in a] == tokens,
            "max_logit_diff": float(np.abs(a - b).max())}  # fmt: skip


def _stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    return {"runs": runs, "wall_min": min(walls), "wall_median": round(statistics.median(walls), 2),
            "peak_rss": max(r["peak_rss"] for r in runs)}  # fmt: skip


def bench_size(ckpt: Path, work: Path, venv: Path, repeat: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "ours_verify": [], "optimum": []}
    agreement: dict[str, Any] = {}
    for round_ in range(repeat):
        for key, done in runs.items():
            warm(ckpt)
            load = os.getloadavg()[0]
            if key == "optimum":
                r = optimum(ckpt, work, venv)
            else:
                r = ours(ckpt, work, key == "ours_verify")
            r["load_before"] = round(load, 1)
            done.append(r)
            print(f"  [{round_}] {key}: {r['wall_s']} s, {r['peak_rss'] / GIB:.2f} GiB, load "
                  f"{load:.1f}" + (f", phases {r['phases']}, export {r['export_phase_seconds']}, "
                  f"steps {r['steps']}, verify {r['verify']}, logits {r['logits']}"
                  if key != "optimum" else ""), flush=True)  # fmt: skip
        if round_ == 0:
            agreement = compare(runs["optimum"][0], runs["ours_verify"][0], work)
            print(f"  optimum's model vs ours in onnxruntime: {agreement}", flush=True)
        for d in ("ours-v", "ours-nv", "optimum"):
            shutil.rmtree(work / d, ignore_errors=True)
    row: dict[str, Any] = {k: _stats(v) for k, v in runs.items()}
    for key in ("ours", "ours_verify"):
        row[f"{key}_ratio"] = round(row[key]["wall_median"] / row["optimum"]["wall_median"], 3)
        pairs = [o["wall_s"] / u["wall_s"] for o, u in zip(runs[key], runs["optimum"], strict=True)]
        row[f"{key}_pair_ratio_median"] = round(statistics.median(pairs), 3)
    row["agreement"] = agreement
    return row


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| checkpoint | optimum (no validation) min / median | peak RSS "
            "| ours verify off min / median | ratio | ours verify on min / median | ratio "
            "| ours peak RSS off / on | load avg |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in results:
        r = size["row"]
        up, o, v = r["optimum"], r["ours"], r["ours_verify"]
        loads = [
            run["load_before"] for k in ("optimum", "ours", "ours_verify") for run in r[k]["runs"]
        ]
        lines.append(
            f"| {size['checkpoint_bytes'] / 1e9:.1f} GB, {size['layers']} l "
            f"| {up['wall_min']:.1f} / {up['wall_median']:.1f} s | {up['peak_rss'] / GIB:.2f} GiB "
            f"| {o['wall_min']:.1f} / {o['wall_median']:.1f} s | {r['ours_ratio']:.2f} "
            f"| {v['wall_min']:.1f} / {v['wall_median']:.1f} s | {r['ours_verify_ratio']:.2f} "
            f"| {o['peak_rss'] / GIB:.2f} / {v['peak_rss'] / GIB:.2f} GiB "
            f"| {min(loads):.1f}-{max(loads):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        ckpt, out, verify = sys.argv[2:5]
        exports = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
        child_ours(Path(ckpt), Path(out), verify == "1", exports)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="3,18", help="checkpoint sizes (3: 1.1 GB, 18: 4.2 GB)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each size")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--optimum-venv", type=Path, default=DEFAULT_OPTIMUM_VENV)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--builder", action="store_true",
                        help="int4 on SmolLM2 beside onnxruntime-genai's model builder "
                        "(bench/onnx_builder.py) instead of float beside optimum")  # fmt: skip
    args = parser.parse_args()
    if args.builder:
        from bench.onnx_builder import main as builder_main

        work = Path(tempfile.mkdtemp(prefix="modelprep-onnx-builder-", dir=args.dir))
        try:
            builder_main(work, args.repeat, args.json or Path("bench-onnx-builder.json"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    args.json = args.json or Path("bench-export-onnx.json")
    if not (args.optimum_venv / "bin" / "python").is_file():
        raise SystemExit(f"no optimum venv at {args.optimum_venv}: see this module's docstring")
    from bench.synth_checkpoint import write_checkpoint
    from tests.fixtures.models import write_tiny_tokenizer

    work = Path(tempfile.mkdtemp(prefix="modelprep-onnx-bench-", dir=args.dir))
    results: list[dict[str, Any]] = []
    try:
        for layers in (int(x) for x in args.layers.split(",")):
            ckpt = work / f"ckpt-{layers}"
            info = write_checkpoint(ckpt, layers, HIDDEN, INTER, VOCAB, shard_size=10**12)
            write_tiny_tokenizer(ckpt)
            print(f"checkpoint: {info['total_bytes'] / 1e9:.2f} GB float32, {layers} layers",
                  flush=True)  # fmt: skip
            row = bench_size(ckpt, work, args.optimum_venv, args.repeat)
            results.append({"layers": layers, "checkpoint_bytes": info["total_bytes"], "row": row})
            shutil.rmtree(ckpt, ignore_errors=True)
            args.json.write_text(json.dumps({"results": results}, indent=2))
        print()
        print(table(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
