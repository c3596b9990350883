"""Benchmark: API latency under load on loopback while jobs run.

    .venv/bin/python bench/api_latency.py [--seconds 30] [--pollers 100] [--streams 5]
                                          [--interval 1.0] [--workers 2]

Starts a real ``modelprep serve`` (API keys on, SQLite, the local pool) on a free loopback
port, keeps two jobs running the whole time (a tiny Llama checkpoint re-submitted as each one
ends: every job is a spawned process importing torch, so the two CPU cores are busy), then for
``--seconds``:

* ``--pollers`` clients each ``GET /v1/jobs/{id}`` of a current job every ``--interval``
  seconds (one keep-alive connection each, a minimal HTTP/1.1 client so that the load
  generator's own CPU stays small; a poll that would start late starts at once);
* ``--streams`` clients follow ``GET /v1/jobs/{id}/events`` of current jobs, reconnecting to a
  new job when one ends (never again to a job whose final event they received, as a real
  follower would not: until the feeder replaced an ended job, they used to reconnect to it in
  a loop, about 25 connections per second that no client makes). A stream still open
  ``STREAM_GRACE_SECONDS`` after the load ended counts as a stream error: its job ended, or will
  not, without the final event reaching it.

Prints p50/p90/p99/max client-side latency of the status polls, their rate and error count
(non-200 or transport error), the events received and stream errors, and the service's own
view from ``/metrics`` (time to response start, per route). Targets: zero errors, p99 < 50 ms.
The load generator runs in this process with uvloop-free asyncio: on a machine shared with the
job processes its own scheduling delay is part of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from httpx_sse import aconnect_sse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.api.auth import key_digest
from tests.fixtures.models import build_checkpoint
from tests.fixtures.service import running_service

KEY = "mp_bench-tenant-key-0123456789abcdef"
ADMIN = "mp_bench-admin-key-0123456789abcdef"
TERMINAL = {"succeeded", "failed", "cancelled"}
STREAM_GRACE_SECONDS = 10


@dataclass
class Figures:
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    events: int = 0
    stream_errors: list[str] = field(default_factory=list)
    jobs_started: int = 0
    jobs_succeeded: int = 0


class JobFeeder:
    """Keeps ``running`` jobs active: submits a new one whenever one ends."""

    def __init__(self, client: httpx.AsyncClient, body: dict[str, object], running: int) -> None:
        self.client, self.body, self.running = client, body, running
        self.active: list[str] = []

    async def top_up(self, figures: Figures) -> None:
        still = []
        for job_id in self.active:
            job = (await self.client.get(f"/v1/jobs/{job_id}")).json()
            if job["status"] in TERMINAL:
                figures.jobs_succeeded += job["status"] == "succeeded"
            else:
                still.append(job_id)
        self.active = still
        while len(self.active) < self.running:
            response = await self.client.post("/v1/jobs", json=self.body)
            response.raise_for_status()
            self.active.append(response.json()["id"])
            figures.jobs_started += 1

    async def run(self, figures: Figures, until: float) -> None:
        while time.monotonic() < until:
            try:
                await self.top_up(figures)
            except httpx.HTTPError as exc:
                figures.errors.append(f"feeder: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.5)


class RawConnection:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams.

    httpx's async pool costs about a millisecond of CPU per request and serializes 100
    connections behind its own locks: on two shared cores the load generator, not the service,
    would set the figures. This one only writes the request and reads the status line, the
    headers and ``Content-Length`` bytes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        request = (f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                   f"Authorization: Bearer {KEY}\r\n\r\n")
        self.writer.write(request.encode())
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.writer = None
            raise
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(int(line.split(":", 1)[1]) for line in lines[1:]
                      if line.lower().startswith("content-length:"))
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def poller(
    url: str, feeder: JobFeeder, figures: Figures, until: float, interval: float, index: int
) -> None:
    parsed = httpx.URL(url)
    connection = RawConnection(parsed.host, parsed.port or 80)
    await asyncio.sleep(interval * index / 100)  # spread the first polls
    next_at = time.monotonic()
    try:
        while next_at < until:
            job_id = feeder.active[index % len(feeder.active)] if feeder.active else "0" * 32
            started = time.perf_counter()
            try:
                status, body = await connection.get(f"/v1/jobs/{job_id}")
                elapsed = time.perf_counter() - started
                if status != 200 and job_id != "0" * 32:
                    figures.errors.append(f"{status} {body[:100]!r}")
                else:
                    figures.latencies.append(elapsed)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                figures.errors.append(f"{type(exc).__name__}: {exc}")
            next_at = max(next_at + interval, time.monotonic())
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    finally:
        connection.close()


async def streamer(
    client: httpx.AsyncClient, feeder: JobFeeder, figures: Figures, until: float, index: int
) -> None:
    ended: set[str] = set()
    while time.monotonic() < until:
        followable = [job_id for job_id in feeder.active if job_id not in ended]
        if not followable:
            await asyncio.sleep(0.1)
            continue
        job_id = followable[index % len(followable)]
        try:
            grace = until + STREAM_GRACE_SECONDS - time.monotonic()
            async with asyncio.timeout(grace), aconnect_sse(
                client, "GET", f"/v1/jobs/{job_id}/events"
            ) as source:
                if source.response.status_code != 200:
                    figures.stream_errors.append(str(source.response.status_code))
                    continue
                async for event in source.aiter_sse():
                    if not event.data:
                        continue  # keep-alive ping
                    figures.events += 1
                    if json.loads(event.data)["status"] in TERMINAL:
                        ended.add(job_id)
                        break
                    if time.monotonic() >= until:
                        return
        except httpx.HTTPError as exc:
            figures.stream_errors.append(f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            figures.stream_errors.append(
                f"job {job_id}: no final event {STREAM_GRACE_SECONDS} s after the load ended"
            )
            return


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (from /proc): what the API costs, whatever else
    runs on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(url: str, args: argparse.Namespace, body: dict[str, object]) -> Figures:
    figures = Figures()
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ) as control:
        feeder = JobFeeder(control, body, running=args.workers)
        await feeder.top_up(figures)
        until = time.monotonic() + args.seconds
        # Each poller has its own keep-alive connection (RawConnection); the streams share one
        # httpx client (a client per task would spend seconds building SSL contexts).
        headers = {"Authorization": f"Bearer {KEY}"}
        streams = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=httpx.Timeout(10, read=30),
            limits=httpx.Limits(max_connections=args.streams + 1),
        )
        async with streams:
            await asyncio.gather(
                feeder.run(figures, until),
                *(poller(url, feeder, figures, until, args.interval, i)
                  for i in range(args.pollers)),
                *(streamer(streams, feeder, figures, until, i) for i in range(args.streams)),
            )
        for job_id in feeder.active:
            await control.delete(f"/v1/jobs/{job_id}")
    return figures


def server_view(url: str) -> list[str]:
    """p50/p99 estimates per route from the service's histogram (bucket upper bounds)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "modelprep_http_request_duration_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                key = f"{s.labels['method']} {s.labels['route']} {s.labels['status']}"
                buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
    lines = []
    for key, points in sorted(buckets.items()):
        points.sort()
        total = points[-1][1]
        if total < 20:
            continue

        def bound(q: float, points: list[tuple[float, float]] = points, total: float = total) -> str:
            le = next(le for le, count in points if count >= q * total)
            return f"<= {le * 1000:g} ms" if le != float("inf") else "> 10 s"

        lines.append(f"  {key:<45} n={int(total):>6}  p50 {bound(0.5):>12}  p99 {bound(0.99):>12}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--streams", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between two polls of one client")
    parser.add_argument("--workers", type=int, default=2, help="jobs kept running")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="modelprep-bench-api-"))
    try:
        models = work / "models"
        build_checkpoint(models / "llama", "llama", "safetensors")
        keys = json.dumps([{"tenant": "bench", "sha256": key_digest(KEY)},
                           {"tenant": "ops", "sha256": key_digest(ADMIN), "admin": True}])
        env = {"MODELPREP_API_KEYS": keys, "MODELPREP_WORKERS": str(args.workers)}
        body: dict[str, object] = {"source": f"file://{models / 'llama'}",
                                   "exports": [{"format": "safetensors"}]}
        with running_service(work / "data", [models], env=env) as svc:
            started, cpu_before = time.monotonic(), cpu_seconds(svc.process.pid)
            figures = asyncio.run(load(svc.url, args, body))
            wall, api_cpu = time.monotonic() - started, cpu_seconds(svc.process.pid) - cpu_before
            view = server_view(svc.url)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lat = [x * 1000 for x in figures.latencies]
    print(f"load: {args.pollers} pollers every {args.interval}s + {args.streams} event streams "
          f"for {args.seconds:.0f}s, {args.workers} jobs kept running "
          f"({figures.jobs_started} started, {figures.jobs_succeeded} succeeded), wall {wall:.1f}s")
    if lat:
        print(f"status polls: n={len(lat)} ({len(lat) / args.seconds:.0f}/s)  "
              f"p50 {statistics.median(lat):.1f} ms  p90 {percentile(lat, 0.9):.1f} ms  "
              f"p99 {percentile(lat, 0.99):.1f} ms  max {max(lat):.1f} ms")
        print(f"API process CPU: {api_cpu:.1f} s for {len(lat)} polls + streams "
              f"({1000 * api_cpu / max(1, len(lat)):.2f} ms per poll, all included); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"errors: {len(figures.errors)}"
          + (f" (first: {figures.errors[0]})" if figures.errors else ""))
    print(f"events received: {figures.events}  stream errors: {len(figures.stream_errors)}"
          + (f" (first: {figures.stream_errors[0]})" if figures.stream_errors else ""))
    print("service side (time to response start, from /metrics):")
    print("\n".join(view))
    ok = not figures.errors and not figures.stream_errors and lat and percentile(lat, 0.99) < 50
    print("target (zero errors, p99 < 50 ms):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
