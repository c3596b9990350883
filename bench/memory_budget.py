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
        [--shape 4096x11008] [--check]

``--check`` also judges every job and exits 1 naming what failed (:func:`violations`): each of
:data:`MUST_FIT` is accepted and succeeds, every succeeded job's manifest records the limit, the
budget, its cgroup confinement and each phase's peaks (process and cgroup), transformers'
reference ran layer by layer with the embedding and head read from the file, onnxruntime ran
with its weights mapped and allocated under half the budget, a refusal names its numbers in
GiB; and throughout, every API poll answered within a second, the service's cgroup saw no OOM
kill and no job's cgroup outlived its job. This was ``tests/e2e/test_memory_budget.py``'s
measurement (five exports and the one job of a 2.76 GB checkpoint in a 1.25 GiB cgroup, about
7 minutes on 2 cores), run as:

    .venv/bin/python bench/memory_budget.py --limit 1.25GiB --sizes 2.76 --shape 1536x4096 --check

The suite keeps a canary of it (that test file: one job, verify on, from a checkpoint larger
than its cgroup, the API polled throughout; a job over its budget stopped typed, with and
without a cgroup).

Needs root (it makes the cgroup: v2 where the machine has the memory controller there, else
v1) and the llama.cpp tools (``make llama-cpp``). About 1 h on 2 cores for both sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.units import parse_size
from tests.fixtures.cgroups import MemoryCgroup, memory_cgroup
from tests.fixtures.service import Poller, ServiceProcess, running_service

VOCAB = 49152
SHAPE = "4096x11008"
"""Default hidden and intermediate sizes (``--shape``)."""

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
MUST_FIT = ("safetensors bf16", "GGUF q8_0", "GGUF Q4_K_M", "ONNX")
"""Verified exports whose every stage streams or maps its weights, the independent reference
included (layer by layer, its embedding and head read from the file): ``--check`` fails if one
is refused. NNEF may be refused at submission, with its numbers, where tract cannot check it."""
REFUSALS = ("verification_too_large", "plan_does_not_fit")
"""What a job its budget cannot hold is refused with at submission: a consumer's check too big
(tract), or the job's plan over the budget."""
SLOWEST_POLL_S = 1.0
"""``--check``: every API answer while jobs run, within this."""
CGROUP_GONE_S = 60.0
"""``--check``: a job's cgroup is removed after the job ends, within this (the pool removes it
once the job process has exited and the page cache charged to it is reclaimed)."""


def checkpoint(work: Path, gigabytes: float, hidden: int, inter: int) -> Path:
    """A checkpoint of at least ``gigabytes`` GB, made once under ``work``."""
    from bench.export_gguf import smollm2_tokenizer
    from bench.synth_checkpoint import write_checkpoint

    layer_bytes = 4 * (4 * hidden * hidden + 3 * hidden * inter)
    embed_bytes = 2 * 4 * VOCAB * hidden
    layers = max(1, -(-int(gigabytes * 1e9 - embed_bytes) // layer_bytes))
    shape = "" if f"{hidden}x{inter}" == SHAPE else f"-{hidden}x{inter}"
    out = work / f"llama-{layers}l{shape}"
    if not (out / "config.json").exists():
        write_checkpoint(out, layers, hidden, inter, VOCAB)
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


@dataclass
class JobRun:
    """One job of the bench: its row of the table, and what ``--check`` judges."""

    row: dict[str, Any]
    problem: dict[str, Any] = field(default_factory=dict)
    """The refusal at submission (problem+json), else empty."""
    done: dict[str, Any] | None = None
    """The finished job's JSON (None: refused)."""
    manifest: dict[str, Any] | None = None
    """Its manifest (None unless it succeeded)."""


def references(value: Any) -> list[dict[str, Any]]:
    """Every summary of transformers' independent reference anywhere in a manifest."""
    if isinstance(value, list):
        return [r for v in value for r in references(v)]
    if not isinstance(value, dict):
        return []
    found = [value] if str(value.get("implementation", "")).startswith("transformers.") else []
    return found + [r for v in value.values() for r in references(v)]


def violations(label: str, run: JobRun, memory: dict[str, Any], cgroup: MemoryCgroup) -> list[str]:
    """What ``--check`` holds against one job (``memory``: ``/readyz``'s at the start)."""
    done, manifest = run.done, run.manifest
    if done is None:
        problem = run.problem
        wrong = [] if str(problem.get("type", "")).endswith(REFUSALS) else [
            f"{label}: refused with {problem.get('type')}, not one of {REFUSALS}"]
        if "GiB" not in str(problem.get("detail")):
            wrong.append(f"{label}: the refusal names no figures: {problem.get('detail')}")
        if label in MUST_FIT:
            wrong.append(f"{label} must fit its budget, refused: {problem.get('detail')}")
        return wrong
    if done["status"] != "succeeded" or manifest is None:
        return [f"{label}: {done['status']}: {done['error']}"]
    wrong = []
    figures = manifest["memory"]
    expected = {"limit_bytes": cgroup.limit, "job_budget_bytes": memory["job_budget_bytes"],
                "confinement": f"cgroup{cgroup.version}"}  # fmt: skip
    wrong += [f"{label}: manifest memory.{k} {figures.get(k)} != {v}"
              for k, v in expected.items() if figures.get(k) != v]  # fmt: skip
    # Each phase reports its job cgroup's charge (page cache and children included). That
    # charge cannot pass the budget, the cgroup's limit: the proof of fitting is the job's
    # success in that cgroup (confinement above), not a comparison that could never fail.
    if not all("peak_rss_bytes" in p and p.get("cgroup_peak_bytes") for p in figures["phases"]):
        wrong.append(f"{label}: a phase without its peaks: {figures['phases']}")
    found = references(manifest)
    # (a GGUF-only job names it in its llama.cpp check; a dispatched model records its mode)
    if not found and not all(e["format"] == "gguf" for e in manifest["exports"]):
        wrong.append(f"{label}: no reference recorded")
    for reference in found:  # transformers' reference never loaded the vocabulary matrices
        streamed = reference.get("mode") in ("layer-by-layer", "module-by-module")
        if not streamed or reference.get("mapped_from_file") != ["lm_head", "model.embed_tokens"]:
            wrong.append(f"{label}: reference not layer by layer from the file: {reference}")
    for export in manifest["exports"]:
        if not any(k in export for k in ("verify", "verification", "llama_cpp")):
            wrong.append(f"{label}: no consumer check recorded for {export['format']}")
        if export["format"] == "onnx":  # onnxruntime ran with its weights memory-mapped
            verify = export.get("verify", {})
            if verify.get("weights") != "mapped" or not (
                    verify.get("ort_peak_anon_bytes", 2**62) < memory["job_budget_bytes"] / 2):
                wrong.append(f"{label}: onnxruntime's weights not mapped or its anonymous "
                             f"peak not under half the budget: {verify}")
    return wrong


def run_job(service: ServiceProcess, poller: Poller, source: Path,
            exports: list[dict[str, Any]]) -> JobRun:  # fmt: skip
    """Submit one job and wait for it."""
    started = time.monotonic()
    with service.client() as client:
        answer = client.post("/v1/jobs", json={"source": source.as_uri(), "exports": exports})
        if answer.status_code != 202:
            problem = answer.json()
            return JobRun({"outcome": f"refused {answer.status_code}: {problem.get('detail')}"},
                          problem)
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
        manifest = None
        if done["status"] == "succeeded":
            manifest = client.get(f"/v1/jobs/{job_id}/artifacts/manifest.json").json()
            phases = manifest.get("memory", {}).get("phases", [])
            row["cgroup_peak"] = max((p.get("cgroup_peak_bytes") or 0 for p in phases), default=0)
            # the job process alone (its phases), apart from the children it waited for, which
            # the job's own metric folds in (wait4's RUSAGE_CHILDREN)
            row["process_peak"] = max((p.get("peak_rss_bytes") or 0 for p in phases), default=0)
            row["children"] = {k: max(_walk(manifest, k)) for k in CHILD_PEAKS if _walk(manifest, k)}
            row["modes"] = sorted({str(m) for m in _walk(manifest, "mode")}) or ["whole"]
    return JobRun(row, done=done, manifest=manifest)


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
    parser.add_argument("--shape", default=SHAPE,
                        help="HIDDENxINTERMEDIATE of the synthetic Llama (float32, 49152 tokens)")
    parser.add_argument("--check", action="store_true",
                        help="judge every job (see the module's docstring); exit 1 on a failure")
    args = parser.parse_args()
    hidden, inter = (int(n) for n in args.shape.split("x"))
    chosen = [e.strip() for e in args.exports.split(",")]
    unknown = set(chosen) - set(EXPORTS)
    if unknown:
        parser.error(f"unknown exports {sorted(unknown)}: choose among {list(EXPORTS)}")
    limit = parse_size(args.limit)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    failures: list[str] = []
    for size in (float(s) for s in args.sizes.split(",")):
        source = checkpoint(args.work, size, hidden, inter)
        weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
        with memory_cgroup(limit) as cgroup, running_service(
            args.work / f"data-{source.name}", [source.parent], env={"MODELPREP_WORKERS": "1"},
            cgroup=cgroup.path,
        ) as service, Poller(service) as poller:  # fmt: skip
            with service.client() as client:
                memory = client.get("/readyz").json()["memory"]
            if args.check:
                expected = {"limit_bytes": limit, "job_budget_bytes": limit - memory[
                    "api_share_bytes"], "limit_source": f"cgroup{cgroup.version}:{cgroup.path}"}
                failures += [f"/readyz memory.{k} {memory.get(k)} != {v}"
                             for k, v in expected.items() if memory.get(k) != v]  # fmt: skip
            jobs = [(label, [spec]) for label, spec in EXPORTS.items() if label in chosen]
            accepted: list[dict[str, Any]] = []
            if args.one_job == "only":
                jobs, accepted = [], [spec for _, [spec] in jobs]
            together = [] if args.one_job == "skip" else [("one job", accepted)]
            for label, exports in [*jobs, *together]:
                if not exports:
                    continue
                run = run_job(service, poller, source, exports)
                row = run.row
                if args.check:
                    failures += violations(label, run, memory, cgroup)
                if jobs and len(exports) == 1 and not row["outcome"].startswith("refused"):
                    accepted += exports  # the one-job row: every export accepted alone
                row.update(label=label, checkpoint_gb=round(weights / 1e9, 2))
                path, slowest = poller.slowest()
                row["slowest_poll_s"] = round(slowest, 3)
                poller.seconds.clear()
                row["service_oom_kills"] = cgroup.oom_kills()
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.check:
                    if slowest >= SLOWEST_POLL_S:
                        failures.append(f"{label}: the API answered {path} in {slowest:.2f} s")
                    failures += [f"{label}: {f}" for f in poller.failures]
                    poller.failures.clear()
                    if row["service_oom_kills"]:
                        failures.append(f"{label}: {row['service_oom_kills']} OOM kills")
                    deadline = time.monotonic() + CGROUP_GONE_S  # removed after the job ends
                    while cgroup.children() and time.monotonic() < deadline:
                        time.sleep(0.5)
                    if cgroup.children():
                        failures.append(f"{label}: a job's cgroup outlived it: {cgroup.children()}")
            if args.check and args.one_job != "skip" and not any(
                    r["label"] == "one job" and r["checkpoint_gb"] == round(weights / 1e9, 2)
                    for r in rows):  # fmt: skip
                failures.append(f"{source.name}: no one-job row (nothing was accepted alone)")
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
    if args.check:
        print("\ncheck: " + ("passed" if not failures else f"{len(failures)} FAILED"))
        for failure in failures:
            print(f"  {failure}")
        if failures:
            sys.exit(1)


if __name__ == "__main__":
    main()
