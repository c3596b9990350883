"""Benchmark: job throughput through 1 vs 2 ``modelprep worker`` processes, and API latency
(p50/p99 of ``GET /v1/jobs/{id}``) while the jobs run.

    .venv/bin/python bench/throughput.py [--jobs 50] [--workers 1,2] [--concurrency 2]

For each worker count: a fresh PostgreSQL database on 127.0.0.1:5432 (created and dropped, as
the tests do), one API process with ``MODELPREP_EXECUTOR=procrastinate``, N worker processes
each running ``--concurrency`` jobs at once, and ``--jobs`` small jobs (a tiny Llama checkpoint
to safetensors). A client thread polls random submitted jobs back to back for the latency
figures. Throughput is jobs per minute between the first submission and the last finish.
Every job is one spawned Python process importing torch, so on a small machine the figure is
dominated by process start-up; CPU shared with other work skews it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures.models import build_checkpoint
from tests.fixtures.postgres import fresh_database
from tests.fixtures.service import running_service, running_worker

TERMINAL = {"succeeded", "failed", "cancelled"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class LatencyProbe(threading.Thread):
    """GETs random jobs back to back until stopped, recording each request's seconds."""

    def __init__(self, url: str, ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.url, self.ids = url, ids
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                if not self.ids:
                    time.sleep(0.01)
                    continue
                job_id = random.choice(self.ids)
                started = time.perf_counter()
                response = client.get(f"/v1/jobs/{job_id}")
                self.samples.append(time.perf_counter() - started)
                response.raise_for_status()
                time.sleep(0.02)


def run_once(workers: int, jobs: int, concurrency: int, model: Path, base: Path) -> dict[str, float]:
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database())
        data = base / f"data-{workers}"
        env = {
            "MODELPREP_EXECUTOR": "procrastinate",
            "MODELPREP_DATABASE_URL": url,
            "MODELPREP_WORKERS": str(concurrency),
            "MODELPREP_MAX_QUEUED": str(jobs),
            "MODELPREP_WORKER_POLL_SECONDS": "0.5",
            "MODELPREP_LOG_LEVEL": "WARNING",
        }
        api = stack.enter_context(running_service(data, [model.parent], env=env))
        for i in range(workers):
            stack.enter_context(running_worker(data, url, [model.parent], env=env, name=f"w{i}"))
        ids: list[str] = []
        probe = LatencyProbe(api.url, ids)
        probe.start()
        body = {"source": f"file://{model}", "exports": [{"format": "safetensors"}],
                "verify": False}
        with api.client() as client:
            for _ in range(jobs):
                response = client.post("/v1/jobs", json=body)
                response.raise_for_status()
                ids.append(response.json()["id"])
            # Jobs end roughly in submission order: look at the oldest pending ones only, so
            # that watching for the end adds little load next to the latency probe.
            pending = list(ids)
            finished: list[dict[str, object]] = []
            while pending:
                time.sleep(0.5)
                while pending:
                    job = client.get(f"/v1/jobs/{pending[0]}").json()
                    if job["status"] not in TERMINAL:
                        break
                    finished.append(job)
                    pending.pop(0)
        probe.stop.set()
        probe.join()
    failed = [j for j in finished if j["status"] != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} jobs did not succeed, e.g. {failed[0]['error']}")
    first = min(datetime.fromisoformat(str(j["created_at"])) for j in finished)
    last = max(datetime.fromisoformat(str(j["finished_at"])) for j in finished)
    seconds = (last - first).total_seconds()
    return {
        "seconds": seconds,
        "jobs_per_minute": 60 * jobs / seconds,
        "p50_ms": 1000 * statistics.median(probe.samples),
        "p99_ms": 1000 * percentile(probe.samples, 0.99),
        "requests": float(len(probe.samples)),
        "max_attempts": float(max(int(str(j["attempts"])) for j in finished)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--workers", default="1,2", help="worker process counts to compare")
    parser.add_argument("--concurrency", type=int, default=2, help="MODELPREP_WORKERS per worker")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="modelprep-bench-") as tmp:
        base = Path(tmp)
        model = build_checkpoint(base / "models" / "llama", "llama", "safetensors")
        print(f"{args.jobs} jobs (tiny llama -> safetensors), {args.concurrency} per worker")
        print(f"{'workers':>7} {'seconds':>8} {'jobs/min':>9} {'GET p50 ms':>11} "
              f"{'GET p99 ms':>11} {'GETs':>6} {'max attempts':>13}")
        for workers in (int(w) for w in args.workers.split(",")):
            r = run_once(workers, args.jobs, args.concurrency, model, base)
            print(f"{workers:>7} {r['seconds']:>8.1f} {r['jobs_per_minute']:>9.1f} "
                  f"{r['p50_ms']:>11.1f} {r['p99_ms']:>11.1f} {int(r['requests']):>6} "
                  f"{int(r['max_attempts']):>13}", flush=True)


if __name__ == "__main__":
    main()
