"""Benchmark: http(s) source download throughput against ``curl -o``, and the downloader's RSS.

    .venv/bin/python bench/download.py [--sizes 256MiB,1GiB] [--repeat 3] [--dir /tmp/...]

For each size, writes a file of pseudo-random bytes, serves it from a loopback HTTP server
(``tests.fixtures.http_server``, sendfile) in a process of its own, then downloads it:

* ``modelprep`` and ``modelprep +sha256``: ``service.sources.http.download_file`` (streamed to
  a .part file, fsync, rename; sha256 verified on the way in the second) in a child process
  that reports its CPU time and peak RSS;
* ``curl``: ``curl -s -o`` of the same URL in the same run.

Runs alternate between the two and the best of ``--repeat`` is kept for each (the machine is
shared; the best run is the least disturbed one).

Prints throughput of both, their ratio, the CPU seconds each spent per GiB (steadier than
wall time on a busy machine) and the downloader's peak RSS per size: the RSS must not grow with
the file size. Big files go to ``--dir`` (default under /tmp), deleted at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.units import parse_size

_CHILD = """
import json, resource, sys, time
from pathlib import Path
from service.config import Settings
from service.stage import InMemoryContext
from service.sources.http import download_file
url, dest, sha = sys.argv[1], Path(sys.argv[2]), (sys.argv[3] or None)
settings = Settings(data_dir=dest.parent / "data")
ctx = InMemoryContext(settings=settings, work_dir=dest.parent)
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
start, cpu_start = time.perf_counter(), cpu()
received = download_file(url, dest, settings, ctx, sha)
elapsed, cpu_seconds = time.perf_counter() - start, cpu() - cpu_start
print(json.dumps({"seconds": elapsed, "cpu": cpu_seconds, "bytes": received,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_payload(path: Path, size: int) -> str:
    """Pseudo-random bytes (incompressible), written in 8 MiB blocks; returns the sha256."""
    digest = hashlib.sha256()
    block = os.urandom(8 * 1024 * 1024)
    with path.open("wb") as f:
        left, i = size, 0
        while left > 0:
            chunk = (i.to_bytes(8, "little") + block[8:])[:left]
            f.write(chunk)
            digest.update(chunk)
            left -= len(chunk)
            i += 1
    return digest.hexdigest()


def mib_s(n: int, seconds: float) -> float:
    return n / seconds / 1024**2


def fetch_ours(url: str, dest: Path, sha: str, size: int) -> dict[str, float]:
    """One download by modelprep in a fresh child process: seconds and peak RSS."""
    dest.parent.mkdir(exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, url, str(dest), sha],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, float] = json.loads(out)
    assert result["bytes"] == size and dest.stat().st_size == size
    dest.unlink()
    return result


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fetch_curl(url: str, dest: Path, size: int) -> tuple[float, float]:
    """One ``curl -o``: wall seconds and CPU seconds."""
    dest.parent.mkdir(exist_ok=True)
    start, cpu_start = time.perf_counter(), _children_cpu()
    subprocess.run(["curl", "-s", "-f", "-o", str(dest), url], check=True)
    seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu_start
    assert dest.stat().st_size == size
    dest.unlink()
    return seconds, cpu


def run(sizes: list[int], work: Path, repeat: int) -> None:
    served = work / "served"
    served.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.fixtures.http_server", str(served)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        base = server.stdout.readline().strip()
        print(
            f"{'size':>7} {'tool':<20} {'MiB/s':>6} {'vs curl':>7} {'CPU s/GiB':>9} "
            f"{'peak RSS MiB':>12}"
        )
        for size in sizes:
            name = f"model-{size}.safetensors"
            sha = write_payload(served / name, size)
            url = f"{base}/{name}"
            runs: dict[str, list[tuple[float, float, float]]] = {}
            for _ in range(repeat):  # interleaved, best of each: the machine is shared
                for label, digest in (("modelprep", ""), ("modelprep +sha256", sha)):
                    ours = fetch_ours(url, work / "ours" / name, digest, size)
                    runs.setdefault(label, []).append(
                        (ours["seconds"], ours["cpu"], ours["peak_rss"])
                    )
                runs.setdefault("curl -o", []).append(
                    (*fetch_curl(url, work / "c" / name, size), 0.0)
                )
            (served / name).unlink()
            curl_seconds = min(runs["curl -o"])[0]
            for label, results in runs.items():
                seconds, cpu, _ = min(results)
                rss = max(r[2] for r in results)
                print(
                    f"{size / 1024**2:>5.0f}Mi {label:<20} {mib_s(size, seconds):>6.0f} "
                    f"{curl_seconds / seconds:>7.2f} {cpu / (size / 1024**3):>9.2f} "
                    f"{rss / 1024**2 if rss else float('nan'):>12.1f}",
                    flush=True,
                )
    finally:
        server.communicate("")
    print("(best of each; modelprep includes its fsync before the rename, curl does not fsync)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="256MiB,1GiB", help="comma-separated, e.g. 256MiB,1GiB,2GiB"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool; best is kept")
    parser.add_argument("--dir", type=Path, default=None, help="where the big files go")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-download-", dir=args.dir))
    try:
        run(sizes, work, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
