"""Benchmark: NNEF export of a >= 4 GB float32 Llama-shaped checkpoint vs torch-to-nnef's dump_llm.

    .venv/bin/python bench/export_nnef.py [--layers 22] [--dir /tmp/nnef-bench] [--verify]
                                          [--gguf f16,q8_0] [--compression q4_0]
                                          [--skip-baseline] [--keep]

Writes a synthetic TinyLlama-1.1B-like checkpoint (hidden 2048, intermediate 5632, 22 layers,
vocab 32000, 16 KV heads so 5.0 GB in float32, one ``model.safetensors`` shard) with ``bench/synth_checkpoint.py`` (never held in RAM), then
runs each measurement in its own child process and prints its wall time and peak RSS:

* ``modelprep``: the job pipeline (:func:`service.jobs.pipeline.run_pipeline`) with one NNEF
  export: meta build, offload store (references into the shard), torch-to-nnef LLM exporter
  reading every weight from the store, no tract verification;
* ``modelprep-verify`` (``--verify``): the same plus the tract check (prompt + 2 greedy steps),
  which runs in a child of the job process: the job's peak and tract's are reported apart
  (``peak_rss_gib`` is the job process, ``tract_child_peak_rss_gib`` tract's: it holds the
  whole archive in RAM, so it grows with the model);
* ``modelprep-gguf-TYPE`` (``--gguf``): the same job with one GGUF export of that type,
  verified by reading it back (the streamed writer's own comparison with ``GGUFWriter`` is
  ``bench/export_gguf.py``);
* ``dump_llm-offload``: ``torch_to_nnef_llm.exporter.dump_llm(device_map="t2n_offload_disk")``
  with its defaults, except ``no_verify=True`` (its tract check needs a tract binary) and
  ``trust_remote_code=False``.

Both children get ``TMPDIR`` inside ``--dir``; everything under it is deleted at the end unless
``--keep``.

Runs of 2026-11-22 (evening) on a 5.05 GB checkpoint, 2 cores shared with other work (load
average 1-4); peak RSS is the job process's, tract's child is given apart:

===========================  ===========================  ==============================
mode                         run A                        run B
===========================  ===========================  ==============================
modelprep (NNEF)             83.8 s, 0.80 GiB             100.5 s, 0.80 GiB
modelprep-verify             138.5 s, 1.05 GiB (+6.34     154.4 s, 0.82 GiB (+6.36 GiB
                             GiB tract child)             tract child)
modelprep-gguf-f16           29.2 s, 0.83 GiB                   -
modelprep-gguf-q8_0          32.3 s, 2.04 GiB (before     45.6 s, 0.94 GiB
                             the heap trim)
dump_llm-offload             166.5 s, 5.15 GiB                  -
===========================  ===========================  ==============================

dump_llm leaves its 4.8 GB ``mkdtemp`` offload directory behind each time. The verified job's own
peak varied between 0.82 and 1.05 GiB over three runs; tract's child holds the whole float32
archive.
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
        "phases": list(dict.fromkeys(str(p) for p in ctx.phases_seen)),
    }


def run_dump_llm(ckpt: Path, out: Path) -> dict[str, Any]:
    from torch_to_nnef_llm.exporter import dump_llm

    from service.exporters.nnef.tract_cli import write_launcher

    launcher = write_launcher(out / "bin")
    dump_llm(
        local_dir=ckpt,
        device_map="t2n_offload_disk",
        export_dirpath=out / "dump",
        tract_specific_path=launcher,
        no_verify=True,
        trust_remote_code=False,
    )
    archive = next((out / "dump").rglob("model.nnef.t*"))
    return {"archive_bytes": archive.stat().st_size}


def child(mode: str, ckpt: Path, out: Path, compression: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    start = time.monotonic()
    if mode.startswith("modelprep-gguf-"):
        detail = run_modelprep(ckpt, out, True, gguf=mode.removeprefix("modelprep-gguf-"))
    elif mode.startswith("modelprep"):
        detail = run_modelprep(ckpt, out, mode == "modelprep-verify", compression)
    else:
        detail = run_dump_llm(ckpt, out)
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


def measure(mode: str, ckpt: Path, base: Path, compression: str | None) -> dict[str, Any]:
    out = base / mode
    tmp = out / "tmp"
    tmp.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(tmp), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--out", str(out)]
    if compression and mode.startswith("modelprep"):
        cmd += ["--compression", compression]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"mode": mode, "error": proc.stderr[-2000:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    leftovers = [p.name for p in tmp.iterdir()]
    result["tmpdir_leftovers"] = len(leftovers)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/nnef-bench"))
    parser.add_argument("--verify", action="store_true", help="also verify with tract (modelprep)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--compression", choices=["q4_0"], help="modelprep runs only")
    parser.add_argument("--gguf", default="", help="also GGUF exports of these types, e.g. f16,q8_0")
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
        ckpt = base / "ckpt"
        start = time.monotonic()
        info = write_checkpoint(ckpt, args.layers, 2048, 5632, 32000, shard_size=10**12)
        write_tiny_tokenizer(ckpt)  # dump_llm insists on a tokenizer.json
        info["seconds"] = round(time.monotonic() - start, 1)
        print(json.dumps({"checkpoint": info}), flush=True)
        modes = ["modelprep"] + (["modelprep-verify"] if args.verify else [])
        modes += [f"modelprep-gguf-{t}" for t in args.gguf.split(",") if t]
        modes += [] if args.skip_baseline else ["dump_llm-offload"]
        for mode in modes:
            print(json.dumps(measure(mode, ckpt, base, args.compression)), flush=True)
            shutil.rmtree(base / mode, ignore_errors=True)  # disk: one export at a time
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
