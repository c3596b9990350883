"""Benchmark: ONNX export of Llama-shaped checkpoints (>= 1 GB and >= 4 GB) vs optimum-onnx.

    .venv/bin/python bench/export_onnx.py [--layers 3,18] [--dir /tmp/onnx-bench]
                                          [--optimum-venv ~/.cache/modelprep/bench-venvs/optimum-onnx]
                                          [--skip-baseline] [--keep]

For each size, writes a synthetic TinyLlama-like float32 checkpoint (hidden 2048, intermediate
5632, vocab 32000; 3 layers = 1.1 GB, 18 layers = 4.2 GB; the largest tensor, the 262 MB
embedding, is the same at both sizes) with ``bench/synth_checkpoint.py``, then runs, each in its
own child process, one after the other:

* ``modelprep``: the job pipeline (:func:`service.jobs.pipeline.run_pipeline`) with one
  ``{"format": "onnx"}`` export: meta build, offload store, dynamo capture on meta, weights
  streamed into ``model.onnx_data``, then onnxruntime's check (prompt + 2 greedy steps with the
  KV cache) in a child of the job. ``peak_rss_gib`` is the job process; the onnxruntime child's
  own peak is ``ort_child_peak_rss_gib`` (it holds every weight: it grows with the model).
* ``optimum``: ``optimum-cli export onnx --task text-generation-with-past`` from optimum-onnx,
  installed in a venv of its own (its transformers pin clashes with ours; never committed):
  loads the model with ``from_pretrained``, traces it with real weights, saves, and validates
  with onnxruntime itself (its default). Its peak RSS is its whole process's (``wait4``).
  Its model is then run by the same onnxruntime decode as ours, on PyTorch's greedy tokens from
  the modelprep run: ``tokens_agreed`` says whether its argmax matched at every step and
  ``max_logit_diff_vs_modelprep`` how far its logits are from our export's.

Peak RSS of the modelprep job: about 0.33 GiB (torch, transformers, onnx) + the largest tensor
(twice when the export casts it) + about 4.5 MiB per layer (the captured graph: nodes, not
weights). Weight bytes do not enter it: 0.83 GiB at 1.1 GB and 0.90 GiB at 4.2 GB here (same
250 MiB largest tensor; the 0.07 GiB between them are the 15 more layers of graph).

Run of 2026-11-23 08:47-08:55 UTC, 2 cores shared with other workloads (whole-process
figures; peak RSS of the job process, the onnxruntime child apart):

=============  ============================  ============================
checkpoint     modelprep (export + verify)   optimum-cli export onnx
=============  ============================  ============================
1.1 GB, 3 l    38.6 s, 0.83 GiB              45.0 s, 4.67 GiB
               (ORT child 1.21 GiB)          (its model in ORT: 1.53 GiB)
4.2 GB, 18 l   124.9 s, 0.90 GiB             111.2 s, 8.69 GiB
               (ORT child 4.45 GiB)          (its model in ORT: 4.00 GiB)
=============  ============================  ============================

Ratios modelprep/optimum: wall 0.86 and 1.12, peak RSS 0.18 and 0.10. onnxruntime agreement:
ours max |logit - PyTorch| 6e-8 and 7e-8 (tolerance 1e-3), greedy tokens equal at every step;
optimum's model gives the same tokens, its logits within 3e-8 and 4e-8 of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OPTIMUM_VENV = Path.home() / ".cache" / "modelprep" / "bench-venvs" / "optimum-onnx"


def run_modelprep(ckpt: Path, out: Path, verify: bool) -> dict[str, Any]:
    """The job's own pipeline on a ``file://`` source with one verified ONNX export."""
    from service.config import Settings
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    settings = Settings(data_dir=out / "var", local_roots=[ckpt.parent])
    layout = JobLayout.for_job(settings, "c" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="c" * 32)
    spec = JobSpec.model_validate(
        {
            "source": f"file://{ckpt}",
            "verify": verify,
            "exports": [{"format": "onnx", "decode_steps": 2}],
        }
    )
    run_pipeline(spec, ctx, layout)
    summary = json.loads((layout.artifacts / "manifest.json").read_text())["exports"][0]
    verified = summary["verify"] or {}
    onnx_dir = layout.artifacts / summary["dir"]
    # Keep the model for the baseline's comparison (outside the job's data dir).
    keep = out.parent / f"{out.name}-model"
    shutil.move(onnx_dir, keep)
    return {
        "data_bytes": summary["data_bytes"],
        "export_seconds": summary["seconds"],
        "phase_seconds": summary["phase_seconds"],
        "model": str(keep / "model.onnx"),
    } | (
        {
            "max_abs_err_vs_pytorch": verified["max_abs_err"],
            "tolerance": verified["tolerance"],
            "tokens": verified["tokens"],
            "tokens_agreed": all(verified["argmax_agreed"]),
            "ort_child_peak_rss_gib": round(verified["ort_peak_rss_bytes"] / 2**30, 3),
        }
        if verified
        else {}
    )


def child(ckpt: Path, out: Path, verify: bool) -> None:
    sys.path.insert(0, str(ROOT))
    start = time.monotonic()
    detail = run_modelprep(ckpt, out, verify)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mode": "modelprep", "seconds": round(time.monotonic() - start, 1),
                      "peak_rss_gib": round(peak / 2**30, 3), **detail}))  # fmt: skip


def timed(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, float, int]:
    """Run ``cmd``; returns (exit status, wall seconds, its own peak RSS bytes:
    :mod:`bench.measure`, which keeps this bench's memory out of the figure)."""
    from bench.measure import run_measured

    result = run_measured(cmd, log, env=env)
    return result["exit"], result["wall_s"], result["peak_rss"]


def decode(model: Path, prompt: list[int], tokens: list[int], work: Path) -> dict[str, Any]:
    """The exporter's own onnxruntime decode (a child process) on ``model``."""
    from service.exporters.onnx.verify import run_ort

    request = {"prompt": np.asarray([prompt], np.int64), "tokens": np.asarray(tokens, np.int64)}
    run = run_ort(model, "decode", request, work)
    return {"logits": run.outputs["logits"], "peak": run.peak_rss_bytes}


def measure_modelprep(ckpt: Path, base: Path, verify: bool) -> dict[str, Any]:
    out = base / "modelprep"
    out.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(out), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, __file__, "--child", "--ckpt", str(ckpt), "--out", str(out)]
    cmd += [] if verify else ["--no-verify"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        return {"mode": "modelprep", "error": proc.stderr[-2000:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure_optimum(ckpt: Path, base: Path, venv: Path, ours: dict[str, Any]) -> dict[str, Any]:
    from service.exporters.common.reference import prompt_ids

    out = base / "optimum"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(base))
    cmd = [str(venv / "bin" / "optimum-cli"), "export", "onnx", "--model", str(ckpt),
           "--task", "text-generation-with-past", str(out)]  # fmt: skip
    code, wall, peak = timed(cmd, env, base / "optimum.log")
    log = (base / "optimum.log").read_text(errors="replace")
    result: dict[str, Any] = {
        "mode": "optimum", "exit": code, "seconds": round(wall, 1),
        "peak_rss_gib": round(peak / 2**30, 3),
        "validation": [ln.strip() for ln in log.splitlines() if "max diff" in ln.lower()
                       or "validat" in ln.lower()][-4:],
    }  # fmt: skip
    if code != 0:
        result["error"] = log[-1500:]
        return result
    if "tokens" in ours:
        prompt = prompt_ids(4, 32000)
        theirs = decode(out / "model.onnx", prompt, ours["tokens"], base / "verify-optimum")
        mine = decode(Path(ours["model"]), prompt, ours["tokens"], base / "verify-modelprep")
        found = [int(np.argmax(row)) for row in theirs["logits"]]
        result["tokens_agreed"] = found == ours["tokens"]
        result["max_logit_diff_vs_modelprep"] = float(
            np.abs(theirs["logits"] - mine["logits"]).max()
        )
        result["ort_child_peak_rss_gib"] = round(theirs["peak"] / 2**30, 3)
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="3,18", help="one checkpoint per value")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/onnx-bench"))
    parser.add_argument("--optimum-venv", type=Path, default=DEFAULT_OPTIMUM_VENV)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--no-verify", action="store_true", help="modelprep without onnxruntime's check"
    )
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.ckpt, args.out, not args.no_verify)
        return

    sys.path.insert(0, str(ROOT))
    from bench.synth_checkpoint import write_checkpoint
    from tests.fixtures.models import write_tiny_tokenizer

    if args.dir.exists():
        raise SystemExit(f"{args.dir} exists; remove it or pass another --dir")
    try:
        for layers in [int(n) for n in args.layers.split(",")]:
            base = args.dir / f"{layers}l"
            ckpt = base / "ckpt"
            info = write_checkpoint(ckpt, layers, 2048, 5632, 32000, shard_size=10**12)
            write_tiny_tokenizer(ckpt)
            print(json.dumps({"checkpoint": info}), flush=True)
            ours = measure_modelprep(ckpt, base, not args.no_verify)
            print(json.dumps({k: v for k, v in ours.items() if k != "model"}), flush=True)
            if not args.skip_baseline:
                print(json.dumps(measure_optimum(ckpt, base, args.optimum_venv, ours)), flush=True)
            shutil.rmtree(base, ignore_errors=True)  # disk: one size at a time
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
