"""Benchmark: NNEF export (+ tract check) of Llama-shaped float32 checkpoints vs torch-to-nnef's
own LLM export CLI with its tract check on.

    .venv/bin/python bench/export_nnef.py [--layers 3,6] [--rounds 3] [--verify] [--skip-off]
                                          [--before CHECKOUT] [--dir /var/tmp/nnef-bench]
                                          [--gguf f16,q8_0] [--compression q4_0]
                                          [--skip-baseline] [--keep]

For each ``--layers`` size, writes a synthetic TinyLlama-like checkpoint (hidden 2048,
intermediate 5632, vocab 32000, 16 KV heads: 0.52 GB of embeddings + 0.21 GB per layer in
float32, one ``model.safetensors`` shard; 22 layers is 5.05 GB) with ``bench/synth_checkpoint.py``
(never held in RAM), then runs ``--rounds`` rounds of the modes below, interleaved, the order
rotated each round (the machine is shared: every mode sees each load phase), each in its own
child process, and prints wall time, peak RSS, the job's phase timings, then min / median per
mode and each round's ratio to the anchor of the same round:

* ``modelprep``: the job pipeline (:func:`service.jobs.pipeline.run_pipeline`) with one NNEF
  export: meta build, offload store (references into the shard), torch-to-nnef LLM exporter
  reading every weight from the store, no tract verification (``--skip-off``: not run);
* ``modelprep-verify`` (``--verify``): the same plus every check a verified job makes: the
  source read by transformers (the independent reference) and by the job's model, then the
  archive run by tract (prompt + 2 greedy steps, then the fixed text) in a child of the job
  process: ``peak_rss_gib`` is the job process, ``tract_child_peak_rss_gib`` tract's (it holds
  the whole archive in RAM, so it grows with the model);
* ``modelprep-verify-before`` (``--before CHECKOUT``): the same job from another checkout
  (e.g. ``git worktree add`` of an earlier commit), in the same rounds;
* ``modelprep-gguf-TYPE`` (``--gguf``): the same job with one GGUF export of that type;
* ``t2n-cli``, the anchor: ``t2n_export_llm_to_tract -d CKPT -e OUT --tract-specific-path TRACT
  --no-trust-remote-code``, torch-to-nnef's own LLM export CLI with its defaults, its tract check
  on (``tract ... run --assert-output-bundle`` per inference mode), given the tract the job uses
  (``service.exporters.nnef.tract_cli``'s launcher on the PyPI bindings) behind a wrapper that
  logs every call: ``tract_checks`` counts them, and a run with none fails.

Every child gets ``TMPDIR`` inside ``--dir``; everything under it is deleted at the end unless
``--keep``.

Runs of 2026-11-27, 2 cores shared with three other engineers' tests (load average 7-10 over
every run: the per-round ratio is the figure, medians swing by 2x between rounds). See
``docs/exports.md`` (NNEF) for the same tables.

Verified NNEF export vs the CLI, 1.14 GB (3 layers), 3 interleaved rounds, load 7.7-9.6
(``--layers 3,6 --rounds 3 --verify --skip-off --before <checkout of 2e138cd>``):

===============================  ========  ========  ===================================
mode                             min       median    ratio to the CLI, per round
===============================  ========  ========  ===================================
t2n-cli (tract check on, 1 run)  137.3 s   142.8 s   1
modelprep-verify-before          100.3 s   113.4 s   1.24, 0.79, 0.73 (median 0.79)
modelprep-verify (after)         78.1 s    109.0 s   1.19, 0.76, 0.57 (median 0.76)
===============================  ========  ========  ===================================

Verify off (the code path neither change touches; an earlier run of the same bench, 3 rounds,
load 6-9, ``--layers 3 --verify``): 23.8 / 38.6 s min / median, 0.26x the CLI's median
(100.7 s) per round; verify on was 84.6 / 89.9 s there.

Profile before (py-spy 20 Hz over one verified job and its tract children, 1.14 GB, 89.9 s
wall): imports ~12 s; read 10.9 s (hash, tie resolution's transformers meta model); offload
16.6 s (transformers' independent reference 9.4 s, the job model's forward ~3 s); export 29.4 s
(torch-to-nnef trace + write 13.9 s, PyTorch greedy reference 7.2 s, sizing the model by
reading every weight back 5.6 s); verify 29.0 s (tract loads the archive twice, 7.7 + 6.7 s;
decode 0.5 s; fixed text 11.3 s). After: one tract load, no sizing reads (see
``docs/exports.md``, NNEF, for what 0.5x would take).

The same run at 1.76 GB (6 layers), 3 rounds, load 3.9-6.7:

===============================  ========  ========  ===================================
mode                             min       median    ratio to the CLI, per round
===============================  ========  ========  ===================================
t2n-cli (tract check on, 1 run)  114.6 s   129.6 s   1
modelprep-verify-before          78.1 s    96.7 s    0.79, 0.68, 0.75 (median 0.75)
modelprep-verify (after)         50.5 s    79.3 s    0.77, 0.44, 0.61 (median 0.61)
===============================  ========  ========  ===================================

Verify phase before 49.8 / 28.7 / 35.0 s, after 36.3 / 15.2 / 24.8 s; peaks: job 0.81 GiB,
tract child 2.27 GiB, CLI 2.75-2.87 GiB.

On a quiet host (2026-11-27, load 0.7-1.5, nothing else running; ``--layers 3,6 --rounds 3
--verify --before <checkout of a336d51>``), min / median and the median of the per-round ratios
to the CLI. ``modelprep-verify-before`` (a336d51) is main's whole-archive check;
``modelprep-verify`` was bf3b40a's fixed text in one prefill a chunk, since reverted for the
whole archive (``docs/exports.md``, NNEF):

==================  ==================  ==================  ==================  ==================
checkpoint          t2n-cli             verify-before       verify (prefill)    verify off
==================  ==================  ==================  ==================  ==================
1.14 GB (3 layers)  43.6 / 45.6 s       42.7 / 47.6 (0.99)  45.4 / 47.9 (1.00)  21.6 / 26.2 (0.55)
1.76 GB (6 layers)  62.7 / 72.6 s       65.6 / 69.7 (0.98)  65.4 / 68.9 (1.04)  31.9 / 32.3 (0.51)
==================  ==================  ==================  ==================  ==================

Earlier figures (2026-11-22, 5.05 GB, load 1-4): modelprep verify off 84-101 s, verify on
138-154 s, ``dump_llm(device_map="t2n_offload_disk", no_verify=True)`` 166.5 s (its check off;
it leaves its 4.8 GB ``mkdtemp`` offload directory behind each time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports KiB); mapped file pages included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_modelprep(
    ckpt: Path, out: Path, verify: bool, compression: str | None = None, gguf: str | None = None
) -> dict[str, Any]:
    """The job's own pipeline (download -> read -> build -> offload -> export -> finalize) on a
    ``file://`` source, as a job process runs it; only the export spec varies (NNEF, or GGUF of
    type ``gguf``)."""
    from service.config import Settings
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    settings = Settings(data_dir=out / "var", local_roots=[ckpt.parent])
    layout = JobLayout.for_job(settings, "b" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="b" * 32)
    export: dict[str, Any] = (
        {"format": "gguf", "type": gguf}
        if gguf
        else {"format": "nnef", "verify": verify, "decode_steps": 2, "compression": compression}
    )
    spec = JobSpec.model_validate(
        {"source": f"file://{ckpt}", "exports": [export], "verify": verify}
    )
    run_pipeline(spec, ctx, layout)
    manifest = json.loads((layout.artifacts / "manifest.json").read_text())
    summary = manifest["exports"][0]
    if gguf:
        return {"gguf_bytes": summary["bytes"], "verified_tensors":
                summary["verification"]["tensors_checked"]}  # fmt: skip
    verified = summary.get("verify") or {}
    return {
        "archive_bytes": summary["archive_bytes"],
        "export_seconds": summary["seconds"],
        "max_abs_err": verified.get("max_abs_err"),
        "tract_child_peak_rss_gib": round(verified.get("tract_peak_rss_bytes", 0) / 2**30, 3),
        "offload_bytes_written": ctx.details.get("offload", {}).get("bytes_written"),
        "phases": {t.phase.value: t.seconds for t in ctx.phases},
    }


def run_t2n_cli(ckpt: Path, out: Path) -> dict[str, Any]:
    """The anchor: torch-to-nnef's own LLM export CLI (``t2n_export_llm_to_tract``) with its
    defaults and its tract check on (it runs the archive through ``tract ... run
    --assert-output-bundle`` for each inference mode), given the same tract as the job
    (``service.exporters.nnef.tract_cli``'s launcher, on the PyPI bindings) and
    ``--no-trust-remote-code``. A child process of its own, as a user runs it."""
    from service.exporters.nnef.tract_cli import write_launcher

    # every tract call goes through a wrapper that logs it: the figures say the check ran
    calls = out / "tract_calls.log"
    counting = out / "bin" / "tract-counting"
    launcher = write_launcher(out / "bin")
    counting.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {launcher} "$@"\n')
    counting.chmod(0o755)
    cli = Path(sys.executable).parent / "t2n_export_llm_to_tract"
    cmd = [str(cli), "-d", str(ckpt), "-e", str(out / "dump"),
           "--tract-specific-path", str(counting), "--no-trust-remote-code"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"t2n_export_llm_to_tract failed: {proc.stderr[-3000:]}")
    archive = next((out / "dump").rglob("model.nnef.t*"))
    logged = calls.read_text().splitlines() if calls.exists() else []
    checked = sum("--assert-output-bundle" in line for line in logged)
    if not checked:
        raise SystemExit("t2n_export_llm_to_tract ran no tract check")
    return {"archive_bytes": archive.stat().st_size, "tract_checks": checked,
            "cli_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                                      / 2**20, 3)}  # fmt: skip


def child(mode: str, ckpt: Path, out: Path, compression: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    start = time.monotonic()
    if mode.startswith("modelprep-gguf-"):
        detail = run_modelprep(ckpt, out, True, gguf=mode.removeprefix("modelprep-gguf-"))
    elif mode.startswith("modelprep"):
        detail = run_modelprep(ckpt, out, mode == "modelprep-verify", compression)
    else:
        detail = run_t2n_cli(ckpt, out)
    print(
        json.dumps(
            {
                "mode": mode,
                "seconds": round(time.monotonic() - start, 1),
                "peak_rss_gib": round(peak_rss_bytes() / 2**30, 3),
                **detail,
            }
        )
    )


def measure(
    mode: str, ckpt: Path, base: Path, compression: str | None, before: Path | None = None
) -> dict[str, Any]:
    """One child run of ``mode``; ``modelprep-verify-before`` runs the verified job from another
    checkout (``before``, e.g. a ``git worktree`` of the previous commit), in the same rounds."""
    out = base / mode
    tmp = out / "tmp"
    tmp.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(tmp), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    script, child_mode = Path(__file__), mode
    if mode == "modelprep-verify-before" and before is not None:
        script, child_mode = before / "bench" / "export_nnef.py", "modelprep-verify"
        env["PYTHONPATH"] = str(before)
    cmd = [sys.executable, str(script), "--child", child_mode, "--ckpt", str(ckpt),
           "--out", str(out)]  # fmt: skip
    if compression and mode.startswith("modelprep"):
        cmd += ["--compression", compression]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"mode": mode, "error": proc.stderr[-2000:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["mode"] = mode
    leftovers = [p.name for p in tmp.iterdir()]
    result["tmpdir_leftovers"] = len(leftovers)
    return result


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """min / median seconds per mode, and the per-round ratios to the anchor in the same round
    (the machine is shared: a round's runs see the same load, so the per-pair ratio is the
    figure to quote, beside the medians)."""
    by_mode: dict[str, list[float]] = {}
    for r in results:
        if "seconds" in r:
            by_mode.setdefault(r["mode"], []).append(r["seconds"])
    out: dict[str, Any] = {
        m: {"min": min(v), "median": statistics.median(v), "runs": v} for m, v in by_mode.items()
    }
    anchor = {
        r["round"]: r["seconds"] for r in results if r["mode"] == "t2n-cli" and "seconds" in r
    }
    for mode in by_mode:
        if mode == "t2n-cli":
            continue
        pairs = [round(r["seconds"] / anchor[r["round"]], 3) for r in results
                 if r["mode"] == mode and "seconds" in r and r["round"] in anchor]  # fmt: skip
        if pairs:
            out[mode]["ratio_to_anchor"] = pairs
            out[mode]["ratio_median"] = statistics.median(pairs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="22", help="comma-separated sizes, e.g. 3,10")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/nnef-bench"))
    parser.add_argument("--verify", action="store_true", help="also verify with tract (modelprep)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-off", action="store_true", help="no verify-off modelprep run")
    parser.add_argument(
        "--before",
        type=Path,
        help="checkout whose verified job runs too, as modelprep-verify-before",
    )
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--compression", choices=["q4_0"], help="modelprep runs only")
    parser.add_argument(
        "--gguf", default="", help="also GGUF exports of these types, e.g. f16,q8_0"
    )
    parser.add_argument("--child")
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.ckpt, args.out, args.compression)
        return

    sys.path.insert(0, str(ROOT))
    from bench.synth_checkpoint import write_checkpoint
    from tests.fixtures.models import write_tiny_tokenizer

    base = args.dir
    if base.exists():
        raise SystemExit(f"{base} exists; remove it or pass another --dir")
    try:
        for layers in [int(n) for n in args.layers.split(",")]:
            ckpt = base / f"ckpt-{layers}"
            start = time.monotonic()
            info = write_checkpoint(ckpt, layers, 2048, 5632, 32000, shard_size=10**12)
            write_tiny_tokenizer(ckpt)  # the CLI insists on a tokenizer.json
            info["seconds"] = round(time.monotonic() - start, 1)
            print(json.dumps({"checkpoint": info}), flush=True)
            modes = [] if args.skip_off else ["modelprep"]
            modes += ["modelprep-verify"] if args.verify else []
            modes += ["modelprep-verify-before"] if args.before else []
            modes += [f"modelprep-gguf-{t}" for t in args.gguf.split(",") if t]
            modes += [] if args.skip_baseline else ["t2n-cli"]
            results = []
            for round_ in range(args.rounds):
                # interleaved, the order rotated each round: each mode sees every load phase
                shift = round_ % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    result = measure(mode, ckpt, base, args.compression, args.before)
                    result.update(round=round_, layers=layers, loadavg=os.getloadavg()[0])
                    results.append(result)
                    print(json.dumps(result), flush=True)
                    shutil.rmtree(base / mode, ignore_errors=True)  # disk: one export at a time
            print(json.dumps({"layers": layers, "summary": summarize(results)}), flush=True)
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
