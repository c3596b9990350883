"""Benchmark: /metrics and the tenant artifact-bytes check with many jobs in the store, before
and after the running totals (``job_totals``), on real SQLite and PostgreSQL.

    .venv/bin/python bench/metrics_scale.py [--jobs 10000,100000] [--before 9ef6bd2]
                                            [--databases sqlite,postgresql] [--scrapes 10]
                                            [--checks 5] [--timeout 600]
                                            [--versions before,after]

For each database and each job count: a fresh database is brought to revision 0004 (the last
one both versions share) and filled with that many ended jobs of one tenant, as real jobs leave
them (phase timeline, byte counters, two artifacts each). Then, on that same database:

1. **before**: the service at ``--before`` (``git archive`` of ``service/`` into a temporary
   directory, put first on PYTHONPATH) is started as a real ``modelprep serve`` on loopback;
2. **after**: the service of this checkout, whose start-up migrates to 0005 (filling
   ``job_totals`` once from the jobs: the "start" column shows that cost).

Each scrapes ``/metrics`` ``--scrapes`` + 1 times (the first is reported apart: the old code
filled its per-job cache then) and reads the API process's RSS and peak RSS (VmHWM) from /proc.
The tenant artifact-bytes check that every submit pays is timed in a child process of each
version: before, ``JobService._check_tenant_limits`` (paging through the tenant's succeeded
jobs); after, ``Admission.check`` inside a transaction (one statement on the totals and the
tenant's queued/running reservations).

Memory bound after: the API's RSS is its start-up RSS plus O(rows of job_totals + running
jobs) per scrape, i.e. independent of the number of jobs N; before it was start-up + c * N
(a cached JobFigures per finished job, plus each 500-job page). Other people's work runs on this
machine: compare before/after within one run, not against another run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import MetaData, Table, create_engine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.jobs.store.migrations import upgrade
from tests.fixtures.postgres import fresh_database
from tests.fixtures.service import running_service

TENANT = "acme"
PHASES = ("download", "read", "build", "offload", "export", "verify", "finalize")
LIMIT_CHECK = """
import json, statistics, sys, time
from pathlib import Path
from service.config import Settings
from service.jobs.store import JobStore
settings = Settings(data_dir=Path(sys.argv[2]), database_url=sys.argv[1],
                    tenant_max_artifact_bytes=2**62)
store = JobStore.from_url(settings.sqlalchemy_url)
try:
    from service.jobs.store.admission import Admission, held_bytes, lock_submits  # after
    limits = Admission(tenant_max_artifact_bytes=settings.tenant_max_artifact_bytes)
    def check():
        with store.transaction() as conn:
            lock_submits(conn)
            limits.check(conn, "acme", 0)
except ImportError:  # before: the service pages through the tenant's succeeded jobs
    from service.jobs.service import JobService
    jobs = JobService(settings=settings, store=store, executor=None)
    def check():
        jobs._check_tenant_limits("acme")
times = []
for _ in range(int(sys.argv[3])):
    started = time.perf_counter()
    check()
    times.append(time.perf_counter() - started)
print(json.dumps({"median_ms": 1000 * statistics.median(times), "max_ms": 1000 * max(times)}))
"""


def job_rows(count: int) -> Iterator[dict[str, object]]:
    """Ended jobs as the pipeline leaves them: 90% succeeded, 8% failed, 2% cancelled."""
    now = datetime.now(UTC)
    for i in range(count):
        created = now - timedelta(seconds=30 * 86400 * (count - i) / count)
        started = created + timedelta(seconds=1 + i % 7)
        finished = started + timedelta(seconds=20 + i % 300)
        status = "succeeded" if i % 50 < 45 else "failed" if i % 50 < 49 else "cancelled"
        t = started
        phases = []
        for n, phase in enumerate(PHASES):
            seconds = 0.2 + (i * (n + 3)) % 97 / 10
            phases.append({"phase": phase, "started_at": t.isoformat(), "seconds": seconds})
            t += timedelta(seconds=seconds)
        size = 50_000_000 + i * 1000
        yield {
            "id": uuid.UUID(int=i + 1).hex, "status": status,
            "phase": "done" if status == "succeeded" else "export", "tenant": TENANT,
            "spec": {"source": f"file:///models/m{i % 40}", "exports": [
                {"format": "safetensors", "dtype": "float16"}, {"format": "gguf"}]},
            "created_at": created, "started_at": started, "finished_at": finished,
            "updated_at": finished, "progress_done": 1, "progress_total": 1,
            "progress_unit": "files", "attempts": 1, "cancel_requested": False, "version": 30,
            "error_type": None if status == "succeeded" else "checkpoint_error",
            "error_message": None if status == "succeeded" else "a tensor is missing",
            "artifacts": [
                {"path": "safetensors/model.safetensors", "size": size, "sha256": "a" * 64},
                {"path": "gguf/model.gguf", "size": size // 2, "sha256": "b" * 64},
            ] if status == "succeeded" else [],
            "metrics": {"bytes_read": 2 * size, "bytes_written": size + size // 2,
                        "bytes_downloaded": 0, "cache_hit": i % 3 != 0,
                        "wall_seconds": 35.5, "peak_rss_bytes": 900_000_000},
            "details": {"phases": phases, "source": {"kind": "local"}},
        }


def fill(url: str, count: int) -> float:
    """Bring a fresh database to 0004 and insert ``count`` ended jobs; seconds taken."""
    started = time.monotonic()
    engine = create_engine(url)
    try:
        upgrade(engine, "0004")
        with engine.begin() as conn:
            jobs = Table("jobs", MetaData(), autoload_with=conn)
            batch: list[dict[str, object]] = []
            for row in job_rows(count):
                batch.append(row)
                if len(batch) == 2000:
                    conn.execute(jobs.insert(), batch)
                    batch = []
            if batch:
                conn.execute(jobs.insert(), batch)
    finally:
        engine.dispose()
    return time.monotonic() - started


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


@contextmanager
def old_tree(commit: str) -> Iterator[Path]:
    """``service/`` of ``commit``, extracted to a temporary directory."""
    tmp = Path(tempfile.mkdtemp(prefix="metrics-before-"))
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "service"],
                                 check=True, capture_output=True).stdout
        tar_path = tmp / "service.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(
    url: str, data_dir: Path, pythonpath: str | None, scrapes: int, checks: int, timeout: float
) -> dict[str, float]:
    env = {"MODELPREP_DATABASE_URL": url, "MODELPREP_METRICS_OPEN": "true",
           "MODELPREP_WORKERS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    started = time.monotonic()
    with running_service(data_dir, env=env, timeout=900) as service:
        start_seconds = time.monotonic() - started
        rss_start = proc_kib(service.process.pid, "VmRSS")
        times = []
        text = ""
        with httpx.Client(base_url=service.url, timeout=timeout) as client:
            for _ in range(scrapes + 1):
                t = time.perf_counter()
                try:
                    response = client.get("/metrics")
                except httpx.TimeoutException:
                    times.append(float("inf"))  # printed as "> timeout"
                    break
                times.append(time.perf_counter() - t)
                assert response.status_code == 200, response.text[:500]
                text = response.text
        pid = service.process.pid
        figures = {
            "start_s": start_seconds,
            "first_ms": 1000 * times[0],
            "median_ms": 1000 * statistics.median(times[1:] or times),
            "max_ms": 1000 * max(times[1:] or times),
            "rss_start_mib": rss_start / 1024,
            "rss_mib": proc_kib(pid, "VmRSS") / 1024,
            "hwm_mib": proc_kib(pid, "VmHWM") / 1024,
        }
    for line in text.splitlines():
        if line.startswith("modelprep_job_bytes_written_total"):
            figures["bytes_written_total"] = float(line.split()[-1])
    print("   ", json.dumps(figures), flush=True)
    try:
        run = subprocess.run(
            [sys.executable, "-c", LIMIT_CHECK, url, str(data_dir), str(checks)],
            capture_output=True, text=True, check=True, cwd=data_dir, timeout=timeout,
            env={**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})},
        )
        figures["limit_check_ms"] = json.loads(run.stdout.strip().splitlines()[-1])["median_ms"]
    except subprocess.TimeoutExpired:
        figures["limit_check_ms"] = float("inf")
    return figures


@contextmanager
def database(kind: str, tmp: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'jobs.db'}"
    else:
        with fresh_database() as url:
            yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="10000,100000")
    parser.add_argument("--before", default="9ef6bd2")
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--scrapes", type=int, default=10)
    parser.add_argument("--versions", default="before,after", help="which code to run")
    parser.add_argument("--checks", type=int, default=5, help="byte-limit checks timed")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds after which a scrape or the checks count as '> timeout'")
    args = parser.parse_args()
    rows = []
    with old_tree(args.before) as before:
        for kind in args.databases.split(","):
            for count in (int(n) for n in args.jobs.split(",")):
                tmp = Path(tempfile.mkdtemp(prefix="metrics-scale-"))
                try:
                    with database(kind, tmp) as url:
                        fill_s = fill(url, count)
                        print(f"{kind} {count} jobs filled in {fill_s:.1f} s", flush=True)
                        for version, path in (("before", str(before)), ("after", None)):
                            if version not in args.versions.split(","):
                                continue
                            figures = measure(url, tmp / version, path, args.scrapes, args.checks,
                                              args.timeout)
                            rows.append((kind, count, version, figures))
                            print(kind, count, version, json.dumps(figures), flush=True)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| database | jobs | code | start s | 1st scrape ms | scrape p50 ms | scrape max ms "
          "| API RSS start MiB | API RSS after MiB | API peak MiB | byte-limit check ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    def ms(value: float) -> str:
        return f"> {args.timeout:.0f} s" if value == float("inf") else f"{value:.1f}"

    for kind, count, version, f in rows:
        print(f"| {kind} | {count} | {version} | {f['start_s']:.1f} | {ms(f['first_ms'])} "
              f"| {ms(f['median_ms'])} | {ms(f['max_ms'])} | {f['rss_start_mib']:.0f} "
              f"| {f['rss_mib']:.0f} | {f['hwm_mib']:.0f} | {ms(f['limit_check_ms'])} |")
    for kind, count, version, f in rows:
        print(f"# {kind} {count} {version}: modelprep_job_bytes_written_total = "
              f"{f.get('bytes_written_total')}")


if __name__ == "__main__":
    main()
