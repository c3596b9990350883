"""Benchmark: s3:// source reads and artifact-store publication against the local-disk path.

    .venv/bin/python bench/objectstore.py [--sizes 512MiB,3GiB] [--dir /tmp/...]

For each size, writes a sharded checkpoint of pseudo-random bytes (config.json, an index and
1 GiB shards), starts a real S3 server (SeaweedFS, ``tests.fixtures.seaweedfs``) on loopback,
then measures, each in a child process of its own (wall time and the child's peak RSS through
``bench/measure.py``):

* ``publish s3``: :meth:`ArtifactStore.publish` of the directory (multipart, per-part SHA-256,
  manifest last) against ``publish local``: ``cp -r`` of the directory on the same disk (what
  writing artifacts to a shared volume costs);
* ``read s3``: :class:`S3Fetcher` fetching the checkpoint into an empty download cache against
  ``read local``: ``cp -r`` of the same files into the cache's disk.

Prints MB/s of each and the ratio, and the s3 children's peak RSS per size: it must not grow
with the checkpoint. The server and the machine share 2 cores, so figures are a floor for a
real object store on other machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_measured
from service.units import parse_size
from tests.fixtures.seaweedfs import start_seaweedfs, stop_seaweedfs

SHARD = 1024**3

_PUBLISH = """
import hashlib, json, sys
from pathlib import Path
from service.jobs.artifact_store import ArtifactStore
from service.config import Settings
from service.fsutil import sha256_file
src, bucket = Path(sys.argv[1]), sys.argv[2]
settings = Settings(data_dir=src.parent / "data", artifact_store=f"s3://{bucket}/bench")
store = ArtifactStore.configured(settings)
names = sorted(p.name for p in src.iterdir() if p.name != "manifest.json")
digests = {n: sha256_file(src / n) for n in names}
(src / "manifest.json").write_text(json.dumps(digests))
import time
start = time.perf_counter()
store.publish(src, store.root.child("job"), digests)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

_READ = """
import json, sys, time
from pathlib import Path
from service.config import Settings
from service.sources import SourceRequest, fetch_source
from service.stage import InMemoryContext
uri, data = sys.argv[1], Path(sys.argv[2])
settings = Settings(data_dir=data, max_download_bytes=1 << 40, cache_max_bytes=1 << 40)
start = time.perf_counter()
fetch_source(SourceRequest(uri), settings, InMemoryContext(settings=settings, work_dir=data))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def write_checkpoint(path: Path, size: int) -> int:
    path.mkdir(parents=True)
    shards = max(1, -(-size // SHARD))
    weight_map = {}
    total = 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        n = min(SHARD, size - total)
        with (path / name).open("wb") as f:
            left = n
            while left:
                block = os.urandom(min(left, 16 * 1024**2))
                f.write(block)
                left -= len(block)
        total += n
        weight_map[f"layer.{i}.weight"] = name
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return total


def timed_copy(src: Path, dest: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (the S3 server's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(code: str, args: list[str], env: dict[str, str], log: Path,
          server_pid: int) -> dict[str, float]:
    """Run ``code`` in a child; its seconds, peak RSS, and the CPU seconds the child and the
    server each spent (where the time goes: the server's write path, not the client)."""
    server_before = cpu_seconds(server_pid)
    before = os.times()
    result = run_measured([sys.executable, "-c", code, *args], log, cwd=ROOT, env=env)
    after = os.times()
    if result["exit"] != 0:
        raise SystemExit(f"child failed:\n{log.read_text()[-3000:]}")
    seconds = json.loads(log.read_text().strip().splitlines()[-1])["seconds"]
    return {"seconds": float(seconds), "peak_rss": float(result["peak_rss"]),
            "cpu": (after.children_user + after.children_system
                    - before.children_user - before.children_system),
            "server_cpu": cpu_seconds(server_pid) - server_before}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="512MiB,3GiB")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-objectstore-", dir=args.dir))
    proc, server = start_seaweedfs(base / "weed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": server.access_key,
           "AWS_SECRET_ACCESS_KEY": server.secret_key, "MODELPREP_S3_ENDPOINT": server.endpoint,
           "MODELPREP_EGRESS_ALLOWLIST": '["127.0.0.1"]'}
    rows = []
    try:
        for label in args.sizes.split(","):
            size = parse_size(label)
            run = base / uuid.uuid4().hex[:8]
            src = run / "ckpt"
            total = write_checkpoint(src, size)
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            server.create_bucket(bucket)
            publish = child(_PUBLISH, [str(src), bucket], env, run / "publish.log", proc.pid)
            local_publish = timed_copy(src, run / "copy-publish")
            shutil.rmtree(run / "copy-publish")
            read = child(_READ, [f"s3://{bucket}/bench/job", str(run / "data")], env,
                         run / "read.log", proc.pid)
            local_read = timed_copy(src, run / "copy-read")
            mb = total / 1e6
            rows.append({
                "size": label,
                "publish_s3_MBps": round(mb / publish["seconds"], 1),
                "publish_local_cp_MBps": round(mb / local_publish, 1),
                "read_s3_MBps": round(mb / read["seconds"], 1),
                "read_local_cp_MBps": round(mb / local_read, 1),
                "publish_peak_rss_MiB": round(publish["peak_rss"] / 1024**2, 1),
                "read_peak_rss_MiB": round(read["peak_rss"] / 1024**2, 1),
                "publish_cpu_s_per_GiB": round(publish["cpu"] / (total / 1024**3), 1),
                "publish_server_cpu_s_per_GiB": round(publish["server_cpu"] / (total / 1024**3), 1),
                "read_cpu_s_per_GiB": round(read["cpu"] / (total / 1024**3), 1),
                "read_server_cpu_s_per_GiB": round(read["server_cpu"] / (total / 1024**3), 1),
            })
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(run)
    finally:
        stop_seaweedfs(proc)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
