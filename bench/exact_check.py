"""The exact check's cost (``service.exporters.gguf.exact``): wall and peak RSS of its extra
work (the file's weights dequantized to a float32 checkpoint, transformers' forward on them
with the rounded twin, one llama-perplexity run) inside a verified q8_0 GGUF job, at ~1 GB and
~5 GB of float32 weights (synthetic Llamas with SmolLM2's 49152-token vocabulary, written by
``bench/synth_checkpoint.py``; deleted afterwards).

    .venv/bin/python bench/exact_check.py [--sizes 1 5] [--max-memory 2GiB]

Measured on a 2-core host shared with other jobs (load 4-8), max_memory 2GiB, before the
unchanged tensors were streamed: 1.01 GB (1 layer, hidden 2048): the exact check 33.1 s of a
56.4 s job, peak RSS 2.16 GB; 4.85 GB (4 layers, hidden 4096): 303.6 s of 456.1 s, peak RSS
4.50 GB (the 49152 x 4096 embedding dequantized whole, with its copies).

After (row blocks of 32 MiB into files of their own; quiet host, load ~1.5): 1.01 GB: 8.9 s of
15.2 s, peak RSS 1.50 GB; 4.85 GB: 58.4 s of 87.9 s, peak RSS 4.37 GB. The peak is VmHWM, which
counts the clean pages of the memory-mapped GGUF and of the float32 files transformers maps;
the anonymous peak is not measured here yet, so this bench does not show the check bounded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.synth_checkpoint import write_checkpoint
from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.memory.procfs import peak_rss, reset_peak_rss
from service.stage import InMemoryContext
from tests.fixtures.near_tie import near_tie_llama

SHAPES = {1: (1, 2048, 5632), 5: (4, 4096, 11008)}
"""GB -> (layers, hidden, intermediate): 1.0 GB and 4.85 GB of float32 weights."""
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def measure(size: int, max_memory: str, root: Path) -> dict[str, Any]:
    from service.exporters.gguf import exact

    layers, hidden, intermediate = SHAPES[size]
    source = root / f"llama-{size}gb"
    summary = write_checkpoint(source, layers, hidden, intermediate, vocab=49152)
    for name in TOKENIZER:
        if (near_tie_llama() / name).is_file():
            shutil.copy(near_tie_llama() / name, source / name)
    figures: dict[str, Any] = {"gb": size, "bytes": summary["total_bytes"]}
    check = exact.check_exact

    def timed(*args: Any, **kwargs: Any) -> dict[str, Any]:
        reset_peak_rss()
        start = time.monotonic()
        report = check(*args, **kwargs)
        figures["exact_wall_s"] = round(time.monotonic() - start, 1)
        figures["exact_peak_rss_bytes"] = peak_rss()
        figures["exact"] = {k: report.get(k) for k in ("kl_mean", "arithmetic_kl_mean", "tolerance")}
        return report

    exact.check_exact = timed  # type: ignore[assignment]
    try:
        config = Settings(data_dir=root / "data", local_roots=[root])
        ctx = InMemoryContext(settings=config, work_dir=root / "work", job_id="b" * 32)
        layout = JobLayout.for_job(config, ctx.job_id)
        layout.prepare()
        ctx = InMemoryContext(settings=config, work_dir=layout.work, job_id=ctx.job_id)
        spec = JobSpec.model_validate({
            "source": f"file://{source}", "max_memory": max_memory,
            "exports": [{"format": "gguf", "type": "q8_0"}],
        })  # fmt: skip
        start = time.monotonic()
        run_pipeline(spec, ctx, layout)
        figures["job_wall_s"] = round(time.monotonic() - start, 1)
    finally:
        exact.check_exact = check  # type: ignore[assignment]
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(root / "data", ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 5], choices=sorted(SHAPES))
    parser.add_argument("--max-memory", default="2GiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exact-check-") as tmp:
        for size in args.sizes:
            print(json.dumps(measure(size, args.max_memory, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
