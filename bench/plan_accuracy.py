"""Benchmark: a job's plan (``"dry_run": true``) against what the job then measures.

    .venv/bin/python bench/plan_accuracy.py [--corpus] [--layers 3,8] [--types ...]
                                            [--dir /var/tmp] [--json bench-plan.json]

A real ``modelprep serve`` (jobs forked from its forkserver, as in production); for each
checkpoint and export, the plan is asked first, then the job runs (``"reuse": false``) and its
recorded figures are read: ``metrics.peak_rss_bytes`` (the job process or its largest child),
the onnxruntime and tract peaks in the manifest, llama-quantize's in the metrics, the artifact
bytes. Checkpoints: with ``--corpus`` the real models of ``tests/fixtures/real_models.py``
(all-MiniLM-L6, SmolLM2-135M); with ``--layers`` synthetic Llama-shaped float32 checkpoints
(``bench/export_gguf.py``'s: hidden 2048, intermediate 5632, vocabulary 49152 with SmolLM2's
real tokenizer; 3 layers = 1.1 GB, 8 layers = 1.9 GB). A markdown table goes to stdout,
each figure as predicted / measured and the ratio.

A child's recorded peak is its own (``service/exporters/common/child_process.py``), compared
with the predicted child's own.
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
EXPORTS: dict[str, dict[str, Any]] = {
    "safetensors": {"format": "safetensors"},
    "gguf-q8_0": {"format": "gguf", "type": "q8_0"},
    "gguf-Q4_K_M": {"format": "gguf", "type": "Q4_K_M"},
    "onnx": {"format": "onnx"},
    "nnef": {"format": "nnef", "decode_steps": 2},
}


def measure(service: Any, source: Path, export: dict[str, Any]) -> dict[str, Any]:
    body = {"source": source.as_uri(), "exports": [export], "reuse": False}
    with service.client() as client:
        plan = client.post("/v1/jobs", json={**body, "dry_run": True}).json()
        job = client.post("/v1/jobs", json=body).json()
    done = service.wait_for(job["id"], timeout=3600)
    row: dict[str, Any] = {"status": done["status"], "plan": plan, "metrics": done["metrics"]}
    if done["status"] != "succeeded":
        row["error"] = done["error"]
        return row
    manifest = service.data_dir / "jobs" / job["id"] / "artifacts" / "manifest.json"
    summary = json.loads(manifest.read_text())["exports"][0]
    row["verify"] = summary.get("verify") or {}
    row["artifact_bytes"] = sum(a["size"] for a in done["artifacts"] if a["path"] != "manifest.json")
    return row


def pairs(row: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """figure -> (predicted, measured) for every figure the job recorded."""
    plan, (export,) = row["plan"], row["plan"]["exports"]
    out = {"job peak": (plan["peak_rss_bytes"], row["metrics"]["peak_rss_bytes"])}
    children = {c["name"]: c["peak_rss_bytes"] for c in export["children"]}
    verify = row.get("verify") or {}
    if "ort_peak_rss_bytes" in verify:
        out["onnxruntime"] = (children["onnxruntime"], verify["ort_peak_rss_bytes"])
    if "tract_peak_rss_bytes" in verify:
        out["tract"] = (children["tract"], verify["tract_peak_rss_bytes"])
    if "quantizer_peak_rss_bytes" in row["metrics"]:
        quantizer = children["llama-quantize"]
        out["llama-quantize"] = (quantizer, row["metrics"]["quantizer_peak_rss_bytes"])
    if "artifact_bytes" in row:
        out["artifacts"] = (plan["disk"]["artifact_bytes"], row["artifact_bytes"])
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| checkpoint | export | figure | predicted | measured | predicted / measured |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if r["status"] != "succeeded":
            lines.append(f"| {r['checkpoint']} | {r['export']} | job {r['status']} | "
                         f"{r.get('error')} | | |")  # fmt: skip
            continue
        for figure, (p, m) in pairs(r).items():
            lines.append(f"| {r['checkpoint']} | {r['export']} | {figure} | {p / GIB:.2f} GiB "
                         f"| {m / GIB:.2f} GiB | {p / m:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="store_true", help="the real corpus")
    parser.add_argument("--layers", default="", help="synthetic sizes, e.g. 3,8")
    parser.add_argument("--exports", default=",".join(EXPORTS))
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=Path("bench-plan.json"))
    args = parser.parse_args()
    from bench.export_gguf import make_checkpoint, smollm2_tokenizer
    from tests.fixtures.real_models import real_model
    from tests.fixtures.service import running_service

    work = Path(tempfile.mkdtemp(prefix="modelprep-plan-bench-", dir=args.dir))
    checkpoints: dict[str, Path] = {}
    try:
        if args.corpus:
            for name in ("minilm", "smollm2"):
                checkpoints[name] = shutil.copytree(real_model(name), work / "models" / name)
        if args.layers:
            smollm2_tokenizer(work / "tokenizer")
            for layers in (int(x) for x in args.layers.split(",")):
                out = work / "models" / f"synthetic-{layers}l"
                summary = make_checkpoint(out, layers, work / "tokenizer")
                checkpoints[f"{summary['total_bytes'] / 1e9:.1f} GB ({layers} l)"] = out
        results: list[dict[str, Any]] = []
        with running_service(work / "data", [work / "models"]) as service:
            for label, path in checkpoints.items():
                for name in args.exports.split(","):
                    row = measure(service, path, EXPORTS[name])
                    row.update(checkpoint=label, export=name)
                    results.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
                    args.json.write_text(json.dumps(results, indent=1, default=str))
        print()
        print(table(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
