"""Peak RSS and wall time of the safetensors exporter (f32 -> bf16) against ``cp -r``.

For each model size (same largest tensor, different layer counts) it generates a synthetic
Llama checkpoint (bench/synth_checkpoint.py) unless present, then measures, in this order and
each with the source evicted from the page cache first (``posix_fadvise(DONTNEED)`` on every
file: no root needed, other processes' cache untouched):

* ``cp -r SRC DST`` (plain, no sync: the target to beat),
* the exporter in a child process (``ru_maxrss`` of that child = its peak RSS; includes the
  fsync of every shard it writes).

    .venv/bin/python bench/safetensors_export.py --layers 3 7 [--keep]

Walls are medians of ``--rounds`` interleaved pairs (the host is shared); peak RSS is the max.
Targets: peak RSS <= 2 x largest tensor + 512 MiB; exporter wall <= 1.0 x cp -r.
Generated data lives under var/bench (gitignored) and is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.checkpoint.base import TensorInfo

MiB = 1024 * 1024


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache so every run starts cold."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child_export(src: Path, out: Path, dtype: str, chunk_mib: int) -> None:
    """Runs in the child: export and print figures as one JSON line."""
    import service.exporters.safetensors as st
    from service.checkpoint import open_checkpoint
    from service.config import Settings
    from service.exporters.base import ExportInputs
    from service.exporters.safetensors import writer
    from service.stage import InMemoryContext

    writer.CHUNK_BYTES = chunk_mib * MiB
    ctx = InMemoryContext(settings=Settings(data_dir=out.parent / ".var"), work_dir=out.parent)
    start = time.monotonic()
    with open_checkpoint(src) as ckpt:
        result = st.SafetensorsExporter().export(
            st.SafetensorsSpec(dtype=dtype),  # type: ignore[arg-type]
            ExportInputs(checkpoint=ckpt),
            out,
            ctx,
        )
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * 1024
    print(
        json.dumps(
            {
                "wall": wall,
                "peak_rss": peak,
                "cpu": usage.ru_utime + usage.ru_stime,
                "shards": result.summary["shards"],
                "bytes_read": ctx.metrics["bytes_read"],
                "bytes_written": ctx.metrics["bytes_written"],
            }
        )
    )


def run_export(src: Path, out: Path, dtype: str, chunk_mib: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(src), str(out), dtype, str(chunk_mib)]
    start = time.monotonic()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    figures: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["process_wall"] = time.monotonic() - start
    return figures


def run_cp(src: Path, dst: Path) -> tuple[float, float]:
    """Wall of ``cp -r``, and of ``cp -r`` plus an fsync of every copy (what the export pays)."""
    start = time.monotonic()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    copied = time.monotonic() - start
    for f in sorted(dst.iterdir()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return copied, time.monotonic() - start


@dataclass
class BenchRow:
    layers: int
    source_bytes: int
    largest_tensor: int
    cp_wall: float
    cp_fsync_wall: float
    export_wall: float
    peak_rss: int
    export_cpu: float
    """User + system CPU seconds of the export process (cast, sha256, copies)."""
    shards: int
    load_average: float
    """1-minute load average at the end (the host has 2 cores shared with other work)."""

    @property
    def rss_budget(self) -> int:
        return 2 * self.largest_tensor + 512 * MiB

    @property
    def wall_ratio(self) -> float:
        return self.export_wall / self.cp_wall

    def line(self) -> str:
        return (
            f"layers={self.layers} source={self.source_bytes / 1e9:.2f} GB  "
            f"cp -r {self.cp_wall:.1f}s (+fsync {self.cp_fsync_wall:.1f}s)  "
            f"export {self.export_wall:.1f}s (x{self.wall_ratio:.2f}, cpu {self.export_cpu:.1f}s)  "
            f"peak RSS {self.peak_rss / MiB:.0f} MiB (budget {self.rss_budget / MiB:.0f} MiB, "
            f"ok={self.peak_rss <= self.rss_budget})  load {self.load_average:.1f}"
        )


def bench(layers: int, work: Path, dtype: str, chunk_mib: int, keep: bool, rounds: int) -> BenchRow:
    """``rounds`` interleaved (cp -r, export) pairs; medians, since the host is shared."""
    from bench.synth_checkpoint import write_checkpoint

    src = work / f"llama-{layers}l"
    if not (src / "config.json").exists():
        print(f"generating {src} ...", file=sys.stderr)
        write_checkpoint(src, layers=layers)
    cps: list[tuple[float, float]] = []
    exports: list[dict[str, float]] = []
    try:
        largest = max(i.nbytes for i in _infos(src))
        for _ in range(rounds):
            evict(src)
            cps.append(run_cp(src, work / "cp-copy"))
            shutil.rmtree(work / "cp-copy")
            evict(src)
            exports.append(run_export(src, work / "export", dtype, chunk_mib))
            shutil.rmtree(work / "export")
            print(f"  round: cp {cps[-1][0]:.1f}s export {exports[-1]['wall']:.1f}s", flush=True)
    finally:
        for leftover in (work / "cp-copy", work / "export"):
            shutil.rmtree(leftover, ignore_errors=True)
        size = sum(f.stat().st_size for f in src.iterdir())
        if not keep:
            shutil.rmtree(src, ignore_errors=True)
    return BenchRow(
        layers=layers,
        source_bytes=size,
        largest_tensor=largest,
        cp_wall=statistics.median(c[0] for c in cps),
        cp_fsync_wall=statistics.median(c[1] for c in cps),
        load_average=os.getloadavg()[0],
        export_wall=statistics.median(e["wall"] for e in exports),
        peak_rss=int(max(e["peak_rss"] for e in exports)),
        export_cpu=statistics.median(e["cpu"] for e in exports),
        shards=int(exports[0]["shards"]),
    )


def _infos(src: Path) -> list[TensorInfo]:
    from service.checkpoint import open_checkpoint

    with open_checkpoint(src) as ckpt:
        return ckpt.reader.tensor_infos()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_export(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--work", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--keep", action="store_true", help="keep generated sources")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    for layers in args.layers:
        row = bench(layers, args.work, args.dtype, args.chunk_mib, args.keep, args.rounds)
        print(row.line(), flush=True)


if __name__ == "__main__":
    main()
