"""Benchmark: completion callbacks, on SQLite and PostgreSQL, with a large job store.

    .venv/bin/python bench/callbacks.py [--rows 100000] [--burst 500] [--poll 1.0]
                                        [--backends sqlite,postgresql]

For each backend, a fresh store holding ``--rows`` ended jobs (half of them with a callback
already delivered, as after months of use), then:

* **idle poll**: what every API process and worker pays each ``callback_poll_seconds`` when no
  callback is due: ``JobStore.due_callbacks`` (p50/p99 over 300 calls) and the query plan
  (it must be a range on ``ix_jobs_callback_next_at``, not a scan of the rows);
* **burst**: ``--burst`` jobs end at once, each with a callback to a real receiver on loopback
  (a ThreadingHTTPServer that verifies every signature, tests/fixtures/callback_receiver.py);
  one :class:`CallbackDeliverer` thread (default poll and concurrency) delivers them. Prints
  the latency from each job's ``finished_at`` to the receiver getting the POST (p50/p99/max),
  and deliveries per second; every signature must verify.

The figures depend on the machine's load: the receiver, the deliverer and the database share
its cores. Compare the two backends of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text

from service.api.schemas import job_json
from service.config import Settings
from service.jobs.callbacks import CallbackDeliverer
from service.jobs.model import CallbackDelivery, CallbackState, Job, JobStatus, Phase
from service.jobs.store import JobStore, jobs_table, utcnow
from tests.fixtures.callback_receiver import CallbackReceiver
from tests.fixtures.postgres import fresh_database

SECRET = "bench-callback-secret-0123456789"


@contextmanager
def store_for(backend: str, tmp: Path) -> Iterator[JobStore]:
    if backend == "sqlite":
        store = JobStore.from_url(f"sqlite:///{tmp / 'jobs.db'}")
        try:
            store.create_schema()
            yield store
        finally:
            store.dispose()
        return
    with fresh_database() as url:
        store = JobStore.from_url(url)
        try:
            store.create_schema()
            yield store
        finally:
            store.dispose()


def fill(store: JobStore, rows: int) -> None:
    """``rows`` succeeded jobs, every other one with a delivered callback."""
    now = utcnow()
    batch: list[dict[str, Any]] = []
    with store.transaction() as conn:
        for i in range(rows):
            at = now - timedelta(seconds=rows - i)
            callback = i % 2 == 0
            spec: dict[str, Any] = {"source": "file:///m", "exports": [{"format": "safetensors"}]}
            if callback:
                spec["callback"] = {"url": "https://hooks.example.com/x"}
            batch.append({
                "id": uuid.uuid4().hex, "status": "succeeded", "phase": "done", "spec": spec,
                "tenant": None, "created_at": at, "started_at": at, "finished_at": at,
                "updated_at": at, "progress_done": 0, "progress_total": None,
                "progress_unit": "bytes", "artifacts": [], "metrics": {}, "details": {},
                "attempts": 1, "cancel_requested": False, "version": 3,
                "callback_state": "delivered" if callback else None,
                "callback_attempts": 1 if callback else 0,
                "callback_delivered_at": at if callback else None,
            })
            if len(batch) == 5000:
                conn.execute(jobs_table.insert(), batch)
                batch = []
        if batch:
            conn.execute(jobs_table.insert(), batch)
        if conn.dialect.name == "postgresql":
            conn.execute(text("ANALYZE jobs"))
        else:
            conn.execute(text("ANALYZE"))


def plan(store: JobStore) -> str:
    with store.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            rows = conn.execute(text(
                "EXPLAIN SELECT id FROM jobs WHERE callback_next_at <= now() "
                "ORDER BY callback_next_at LIMIT 64")).all()
        else:
            rows = conn.execute(text(
                "EXPLAIN QUERY PLAN SELECT id FROM jobs WHERE callback_next_at <= "
                "'2100-01-01' ORDER BY callback_next_at LIMIT 64")).all()
    return " | ".join(str(r[-1]) for r in rows)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def idle_poll(store: JobStore) -> tuple[float, float]:
    timings = []
    for _ in range(300):
        started = time.perf_counter()
        assert store.due_callbacks(utcnow(), 64) == []
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings), pct(timings, 0.99)


def burst(store: JobStore, settings: Settings, count: int) -> dict[str, float]:
    receiver = CallbackReceiver(secret=SECRET.encode())
    deliverer = CallbackDeliverer(settings, store, render=job_json)
    try:
        ids = []

        for _ in range(count):
            job = Job(id=uuid.uuid4().hex, status=JobStatus.QUEUED, phase=Phase.QUEUED,
                      spec={"source": "file:///m", "exports": [{"format": "safetensors"}],
                            "callback": {"url": receiver.url}},
                      created_at=utcnow(),
                      callback=CallbackDelivery(url=receiver.url, state=CallbackState.WAITING))
            store.create(job)
            store.claim(job.id, "bench:1")
            ids.append(job.id)
        deliverer.start()
        started = time.perf_counter()
        finished_at = {}
        for job_id in ids:
            store.finish(job_id, JobStatus.SUCCEEDED)
            finished_at[job_id] = time.time()
        deadline = time.monotonic() + 600
        while len(receiver.deliveries) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(receiver.deliveries)}/{count} delivered in 600 s")
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
        deliveries = receiver.deliveries
        bad = [d for d in deliveries if not d.signature_valid]
        if bad:
            raise SystemExit(f"{len(bad)} deliveries with an invalid signature")
        latencies = [d.received_at - finished_at[d.headers["X-Modelprep-Job-Id"]]
                     for d in deliveries]
        return {
            "p50": statistics.median(latencies), "p99": pct(latencies, 0.99),
            "max": max(latencies), "rate": count / elapsed,
            "sent": len(deliveries),
        }
    finally:
        deliverer.stop()
        receiver.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args()
    print("| backend | job rows | idle poll p50 | idle poll p99 | burst | first POST after "
          "job end p50 / p99 / max | deliveries/s | plan |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, store_for(backend, Path(tmp)) as store:
            settings = Settings.model_validate({
                "data_dir": Path(tmp), "callback_secret": SECRET,
                "egress_allowlist": ["127.0.0.0/8"], "callback_poll_seconds": args.poll,
            })
            fill(store, args.rows)
            p50, p99 = idle_poll(store)
            result = burst(store, settings, args.burst)
            print(
                f"| {backend} | {args.rows} | {p50:.2f} ms | {p99:.2f} ms | {args.burst} | "
                f"{result['p50']:.2f} / {result['p99']:.2f} / {result['max']:.2f} s | "
                f"{result['rate']:.0f} | {plan(store)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
