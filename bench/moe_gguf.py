"""Benchmark: GGUF of a Mixtral-shaped checkpoint at two sizes, our streamed experts against
llama.cpp's own converter, which evaluates each layer's expert stack whole.

    .venv/bin/python bench/moe_gguf.py [--experts 8,24] [--layers 2] [--dir /var/tmp]
                                       [--skip-upstream] [--json bench-moe-gguf.json]

For each expert count, a synthetic float32 Mixtral checkpoint in the Hub's layout
(``tests/fixtures/moe.py``: hidden 2048, intermediate 5632, SmolLM2's real 49152-token
tokenizer, which llama.cpp's converter needs, ``--layers`` layers; the expert stack of one projection is ``experts x 5632 x 2048 x 4`` bytes: 369 MB at
8 experts, 1.1 GB at 24), then, each in its own child measured by ``bench/measure.py``:

* ``ours``: the GGUF exporter as a job runs it, f16, with the read-back (``verify`` on);
* ``upstream``: ``convert_hf_to_gguf.py`` of the pinned llama.cpp, f16, lazy mode (its default).

The plan's prediction for our export (``service/exporters/gguf/plan.py``, the dense formula) is printed
beside it. The checkpoint is read once before each run so both start with it in the page cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1024**3
HIDDEN, INTER, VOCAB = 2048, 5632, 49152


def predicted(ckpt: Path) -> int:
    """The plan's job peak for an f16 export with the read-back, from the headers alone."""
    from service.config import Settings
    from service.jobs.planning import plan_spec, source_headers
    from service.jobs.spec import JobSpec

    settings = Settings(data_dir=ckpt.parent / "plan-var", local_roots=[ckpt.parent])
    spec = JobSpec.model_validate(
        {"source": ckpt.as_uri(), "exports": [{"format": "gguf", "type": "f16"}]}
    )
    return int(plan_spec(spec, source_headers(spec, settings), settings).peak_rss_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="8,24")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("bench-moe-gguf.json"))
    args = parser.parse_args()
    from bench.export_gguf import run_measured, smollm2_tokenizer, upstream_converter, warm
    from tests.fixtures.moe import write_mixtral

    work = Path(tempfile.mkdtemp(prefix="modelprep-moe-bench-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        converter = None if args.skip_upstream else upstream_converter(work)
        smollm2_tokenizer(work / "tokenizer")
        for experts in (int(x) for x in args.experts.split(",")):
            ckpt = work / f"mixtral-{experts}"
            summary = write_mixtral(ckpt, args.layers, experts, HIDDEN, INTER, VOCAB)
            for f in (work / "tokenizer").iterdir():
                shutil.copy(f, ckpt / f.name)
            row: dict[str, Any] = {**summary, "predicted_peak": predicted(ckpt)}
            out = work / f"ours-{experts}"
            warm(ckpt)
            row["ours"] = run_measured(
                [sys.executable, str(ROOT / "bench" / "export_gguf.py"), "--child", str(ckpt),
                 str(out), "f16", "1"], work / f"ours-{experts}.log",
            )  # fmt: skip
            shutil.rmtree(out, ignore_errors=True)
            if converter is not None:
                warm(ckpt)
                dest = work / f"upstream-{experts}.gguf"
                row["upstream"] = run_measured(
                    [sys.executable, str(converter), str(ckpt), "--outfile", str(dest),
                     "--outtype", "f16"], work / f"upstream-{experts}.log",
                )  # fmt: skip
                dest.unlink(missing_ok=True)
            shutil.rmtree(ckpt, ignore_errors=True)
            rows.append(row)
            args.json.write_text(json.dumps(rows, indent=2))
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| checkpoint | experts | stack (1 projection, f32) | ours: wall, peak RSS | plan "
          "| llama.cpp convert: wall, peak RSS |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        up = r.get("upstream")
        upstream = f"{up['wall_s']:.0f} s, {up['peak_rss'] / GIB:.2f} GiB" if up else "-"
        print(f"| {r['total_bytes'] / 1e9:.1f} GB | {r['experts']} | {r['stack_bytes'] / GIB:.2f} "
              f"GiB | {r['ours']['wall_s']:.0f} s, {r['ours']['peak_rss'] / GIB:.2f} GiB | "
              f"{r['predicted_peak'] / GIB:.2f} GiB | {upstream} |")


if __name__ == "__main__":
    main()
