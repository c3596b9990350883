"""Issue-2 benchmark: a synthetic Llama (f32, 1 GB shards) prepared to bfloat16 safetensors
through the service's own job runner, against ``cp -r`` of the same directory in the same run.

The job goes the production way: a row in a SQLite job store, the local executor's spawned job
process (imports included), the full pipeline (read, build on meta, export, manifest, publish).
Peak RSS is the job process's own ``ru_maxrss`` (reported in the job's metrics) and, checked
independently, the largest RSS psutil saw while sampling that process every 20 ms.

    .venv/bin/python bench/prepare_safetensors.py --layers 3 7 [--rounds 2] [--keep]

Each run starts with the source evicted from the page cache. Generated data lives under
var/bench (gitignored) and is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.safetensors_export import evict, run_cp
from bench.synth_checkpoint import write_checkpoint
from service.config import Settings
from service.jobs.executors.local import LocalExecutor
from service.jobs.executors.process import warm_up
from service.jobs.model import Job, JobStatus, Phase
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore, utcnow

MiB = 1024 * 1024


class RssSampler(threading.Thread):
    """Largest RSS of any job process (session leader child of this process) while running."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stopped.is_set():
            for child in me.children(recursive=True):
                try:
                    if os.getsid(child.pid) == child.pid:
                        self.peak = max(self.peak, child.memory_info().rss)
                except (psutil.Error, ProcessLookupError):
                    pass
            time.sleep(0.02)


def run_job(src: Path, data_dir: Path, verify: bool) -> dict[str, float]:
    settings = Settings(data_dir=data_dir, local_roots=[src.parent], workers=1)
    settings.jobs_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore.from_url(settings.sqlalchemy_url)
    store.create_schema()
    executor = LocalExecutor(settings, store)
    spec = JobSpec.model_validate(
        {"source": f"file://{src}", "verify": verify,
         "exports": [{"format": "safetensors", "dtype": "bfloat16"}]}
    )
    job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED,
              spec=spec.stored(), created_at=utcnow())
    sampler = RssSampler()
    sampler.start()
    started = time.monotonic()
    executor.start()
    executor.submit(job, {})
    while not (done := store.get(job.id)).status.terminal:
        time.sleep(0.05)
    wall = time.monotonic() - started
    sampler.stopped.set()
    executor.stop()
    store.dispose()
    if done.status is not JobStatus.SUCCEEDED:
        raise SystemExit(f"job {done.status}: {done.error}")
    phases = {p.phase.value: round(p.seconds or 0.0, 1) for p in done.phases}
    print(f"  phases: {phases}", flush=True)
    return {
        "wall": wall,
        "job_wall": float(done.metrics["wall_seconds"]),
        "peak_rss": float(done.metrics["peak_rss_bytes"]),
        "sampled_peak_rss": float(sampler.peak),
    }


@dataclass
class Row:
    layers: int
    source_bytes: int
    largest: int
    cp: float
    job: float
    job_inner: float
    peak_rss: float
    sampled_peak_rss: float

    def line(self) -> str:
        budget = 2 * self.largest + 512 * MiB
        return (
            f"layers={self.layers} source={self.source_bytes / 1e9:.2f} GB largest tensor "
            f"{self.largest / MiB:.0f} MiB | cp -r {self.cp:.1f}s | job {self.job:.1f}s "
            f"(pipeline {self.job_inner:.1f}s) ratio x{self.job / self.cp:.2f} | peak RSS "
            f"{self.peak_rss / MiB:.0f} MiB (sampled {self.sampled_peak_rss / MiB:.0f} MiB; "
            f"budget {budget / MiB:.0f} MiB, ok={self.peak_rss <= budget})"
        )


def bench(layers: int, work: Path, rounds: int, keep: bool, verify: bool) -> Row:
    from service.checkpoint import open_checkpoint

    src = work / "models" / f"llama-{layers}l"
    if not (src / "config.json").exists():
        print(f"generating {src} ...", file=sys.stderr, flush=True)
        write_checkpoint(src, layers=layers)
    with open_checkpoint(src) as ckpt:
        largest = max(i.nbytes for i in ckpt.reader.tensor_infos())
    size = sum(f.stat().st_size for f in src.iterdir())
    cps, jobs = [], []
    try:
        for _ in range(rounds):
            evict(src)
            cps.append(run_cp(src, work / "cp-copy")[0])
            shutil.rmtree(work / "cp-copy")
            evict(src)
            jobs.append(run_job(src, work / "service", verify))
            shutil.rmtree(work / "service")
            print(f"  round: cp -r {cps[-1]:.1f}s  job {jobs[-1]['wall']:.1f}s", flush=True)
    finally:
        shutil.rmtree(work / "cp-copy", ignore_errors=True)
        shutil.rmtree(work / "service", ignore_errors=True)
        if not keep:
            shutil.rmtree(src, ignore_errors=True)
    return Row(
        layers=layers, source_bytes=size, largest=largest,
        cp=statistics.median(cps),
        job=statistics.median(j["wall"] for j in jobs),
        job_inner=statistics.median(j["job_wall"] for j in jobs),
        peak_rss=max(j["peak_rss"] for j in jobs),
        sampled_peak_rss=max(j["sampled_peak_rss"] for j in jobs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--verify", action="store_true", help="also run the verify phase")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    # The service starts its forkserver when it starts, not on a job: measure jobs, not that.
    warm_up()
    rows = [bench(n, args.work.resolve(), args.rounds, args.keep, args.verify) for n in args.layers]
    print(f"load average {os.getloadavg()[0]:.1f} (2 cores)")
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    main()
