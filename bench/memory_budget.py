"""Every export of a checkpoint far larger than memory, through a real service in a memory cgroup.

Issue 21's table: a Llama-shaped float32 checkpoint (hidden 4096, SmolLM2's real 49152-token
tokenizer, random weights written a chunk at a time by ``bench/synth_checkpoint.py``) at two
sizes, each exported by a real ``modelprep serve`` living in a memory cgroup of ONE fixed limit
(default 2.5 GiB, at most a quarter of the larger checkpoint): safetensors bf16, GGUF q8_0, GGUF
Q4_K_M, ONNX and NNEF, each as its own job with verify on, then every export accepted alone in
one job (``--one-job only`` runs that job alone, with every chosen export in it; ``skip`` leaves
it out). For each job: outcome, wall, the job's peak (its process's RSS with and without the
children it waited for; its memory cgroup's charge, children and page cache included), each
child's own peak (llama.cpp's quantizer and logits check, onnxruntime, tract: its RSS, mapped
file pages included, without the job's pages wait4 would fold in) and the
verification mode, plus the slowest answer of the API, polled every 0.25 s throughout.

    .venv/bin/python bench/memory_budget.py [--limit 2.5GiB] [--sizes 5,10] [--work var/bench]
        [--exports "safetensors bf16,NNEF"] [--one-job after|only|skip]

Needs root (it makes the cgroup: v2 where the machine has the memory controller there, else
v1) and the llama.cpp tools (``make llama-cpp``). About 1 h on 2 cores for both sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.units import parse_size
from tests.fixtures.cgroups import memory_cgroup
from tests.fixtures.service import Poller, ServiceProcess, running_service

HIDDEN, INTER, VOCAB = 4096, 11008, 49152
LAYER_BYTES = 4 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER)
EMBED_BYTES = 2 * 4 * VOCAB * HIDDEN

EXPORTS: dict[str, dict[str, Any]] = {
    "safetensors bf16": {"format": "safetensors", "dtype": "bfloat16"},
    "GGUF q8_0": {"format": "gguf", "type": "q8_0"},
    "GGUF Q4_K_M": {"format": "gguf", "type": "Q4_K_M"},
    "ONNX": {"format": "onnx"},
    "NNEF": {"format": "nnef"},
}
CHILD_PEAKS = ("quantizer_peak_rss_bytes", "quantizer_peak_anon_bytes", "llama_cpp_peak_rss_bytes",
               "llama_cpp_peak_anon_bytes", "ort_peak_rss_bytes", "ort_peak_anon_bytes",
               "tract_peak_rss_bytes")
"""Each child's peak RSS (``VmHWM``: its file mappings' resident pages included, which llama.cpp
and onnxruntime's memory-mapped weights fill and the cgroup reclaims under pressure) and, where
recorded, its peak anonymous memory (``RssAnon`` sampled: what it holds that cannot be reclaimed)."""


def checkpoint(work: Path, gigabytes: float) -> Path:
    """A checkpoint of at least ``gigabytes`` GB, made once under ``work``."""
    from bench.export_gguf import smollm2_tokenizer
    from bench.synth_checkpoint import write_checkpoint

    layers = max(1, -(-int(gigabytes * 1e9 - EMBED_BYTES) // LAYER_BYTES))
    out = work / f"llama-{layers}l"
    if not (out / "config.json").exists():
        write_checkpoint(out, layers, HIDDEN, INTER, VOCAB)
    if not (out / "tokenizer.json").exists():  # apart: a first run may stop between the two
        tok = work / "tokenizer"
        if not tok.exists():
            smollm2_tokenizer(tok)
        for f in tok.iterdir():
            shutil.copy(f, out / f.name)
    return out


def _walk(value: Any, key: str) -> list[Any]:
    """Every value of ``key`` anywhere in ``value``."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            found += [v] if k == key else _walk(v, key)
    elif isinstance(value, list):
        for v in value:
            found += _walk(v, key)
    return found


def run_job(service: ServiceProcess, poller: Poller, source: Path,
            exports: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    started = time.monotonic()
    with service.client() as client:
        answer = client.post("/v1/jobs", json={"source": source.as_uri(), "exports": exports})
        if answer.status_code != 202:
            problem = answer.json()
            return {"outcome": f"refused {answer.status_code}: {problem.get('detail')}"}
        job_id = answer.json()["id"]
        poller.jobs.append(job_id)
        done = service.wait_for(job_id, timeout=6 * 3600)
        poller.jobs.remove(job_id)
        row: dict[str, Any] = {
            "outcome": done["status"] if done["error"] is None
            else f"{done['status']}: {done['error']['type']}: {done['error']['message'][:160]}",
            "wall_s": round(time.monotonic() - started, 1),
            "job_peak_rss": done["metrics"].get("peak_rss_bytes"),
        }
        if done["status"] == "succeeded":
            manifest = client.get(f"/v1/jobs/{job_id}/artifacts/manifest.json").json()
            phases = manifest.get("memory", {}).get("phases", [])
            row["cgroup_peak"] = max((p.get("cgroup_peak_bytes") or 0 for p in phases), default=0)
            # the job process alone (its phases), apart from the children it waited for, which
            # the job's own metric folds in (wait4's RUSAGE_CHILDREN)
            row["process_peak"] = max((p.get("peak_rss_bytes") or 0 for p in phases), default=0)
            row["children"] = {k: max(_walk(manifest, k)) for k in CHILD_PEAKS if _walk(manifest, k)}
            row["modes"] = sorted({str(m) for m in _walk(manifest, "mode")}) or ["whole"]
    return row


def gib(value: Any) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, int | float) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", default="2.5GiB")
    parser.add_argument("--sizes", default="5,10", help="checkpoint sizes in GB")
    parser.add_argument("--work", type=Path, default=Path("var/bench/memory-budget"))
    parser.add_argument("--exports", default=",".join(EXPORTS),
                        help="which of the exports, comma-separated (default: all)")
    parser.add_argument("--one-job", choices=("after", "only", "skip"), default="after",
                        help="the job with every export in it: after the separate jobs (with the "
                        "ones accepted alone), only (every chosen export, no separate jobs), skip")
    args = parser.parse_args()
    chosen = [e.strip() for e in args.exports.split(",")]
    unknown = set(chosen) - set(EXPORTS)
    if unknown:
        parser.error(f"unknown exports {sorted(unknown)}: choose among {list(EXPORTS)}")
    limit = parse_size(args.limit)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        source = checkpoint(args.work, size)
        weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
        with memory_cgroup(limit) as cgroup, running_service(
            args.work / f"data-{source.name}", [source.parent], env={"MODELPREP_WORKERS": "1"},
            cgroup=cgroup.path,
        ) as service, Poller(service) as poller:  # fmt: skip
            jobs = [(label, [spec]) for label, spec in EXPORTS.items() if label in chosen]
            accepted: list[dict[str, Any]] = []
            if args.one_job == "only":
                jobs, accepted = [], [spec for _, [spec] in jobs]
            together = [] if args.one_job == "skip" else [("one job", accepted)]
            for label, exports in [*jobs, *together]:
                if not exports:
                    continue
                row = run_job(service, poller, source, exports)
                if jobs and len(exports) == 1 and not row["outcome"].startswith("refused"):
                    accepted += exports  # the one-job row: every export accepted alone
                row.update(label=label, checkpoint_gb=round(weights / 1e9, 2))
                _, slowest = poller.slowest()
                row["slowest_poll_s"] = round(slowest, 3)
                poller.seconds.clear()
                row["service_oom_kills"] = cgroup.oom_kills()
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\nlimit {gib(limit)} GiB (one worker)\n")
    print("| checkpoint | export | result | wall | job peak RSS (with children) | job process "
          "| job cgroup peak | children peak | verification | slowest API poll |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        children = ", ".join(f"{k.removesuffix('_bytes').replace('_peak', '')} {gib(v)}"
                             for k, v in r.get("children", {}).items())
        print(f"| {r['checkpoint_gb']} GB | {r['label']} | {r['outcome']} | {r.get('wall_s', '-')} s "
              f"| {gib(r.get('job_peak_rss'))} GiB | {gib(r.get('process_peak'))} GiB "
              f"| {gib(r.get('cgroup_peak'))} GiB "
              f"| {children or '-'} | {', '.join(r.get('modes', ['-']))} | {r['slowest_poll_s']} s |")


if __name__ == "__main__":
    main()
