"""Benchmark: the NNEF export's peak RSS against the size of the largest tensor (the vocabulary).

    .venv/bin/python bench/nnef_wide.py [--vocab 4096,262144,524288] [--dir /tmp/nnef-wide]
                                        [--verify] [--block-bytes 64MiB] [--keep]

For each ``--vocab``, writes a 1-layer bfloat16 Llama (hidden 256, MLP 512; the embedding and
the head are ``vocab x 256``, exported as float32: 4 MiB at 4096, 256 MiB at 262144, 512 MiB at
524288) with ``bench/synth_checkpoint.py`` (then cast to bfloat16), exports it to NNEF in a
child process (:func:`service.exporters.nnef.exporter.export_nnef`, no store: weights read from
the checkpoint) and prints the child's own peak RSS (``bench/measure.py``) twice: with the
block setting (``MODELPREP_NNEF_BLOCK_BYTES``, default 64 MiB) and with a block larger than
any tensor (``whole``: each weight written, embedded and multiplied whole, as torch-to-nnef
does). ``--verify`` adds PyTorch's greedy reference and tract's check (tract's child is not in
the figure). Everything under ``--dir`` is deleted at the end unless ``--keep``.

Run of 2026-11-28, 2 cores shared with other tests (``--vocab 4096,262144,524288``)::

       vocab  largest f32     blocks      whole
        4096        4 MiB    529 MiB    527 MiB
      262144      256 MiB    695 MiB    875 MiB
      524288      512 MiB    696 MiB   1259 MiB

With blocks the peak stops growing once the largest tensor outgrows the block: 64 MiB read
(bfloat16) + its 128 MiB float32 cast, the plan's term (``weight_block_bytes``: 192 MiB over
the small model's, measured 166-167). Whole, it grows by 1.5 x the float32 tensor (the bfloat16
read and its cast). The code before this setting (main at ed0535b, read by an in-process RSS
sampler) peaked at 888 MiB for the 262144 vocabulary against 511 MiB for 4096: the embedding
and the head were also reloaded whole by the trace (four times, for transformers' ``dtype``),
by two forwards that build the example bundle and by the dtype vote after the export.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import run_measured

ROOT = Path(__file__).resolve().parents[1]


def write_bf16_llama(out: Path, vocab: int) -> None:
    """A 1-layer Llama of hidden 256 with ``vocab`` rows, in bfloat16 (one shard)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bench.synth_checkpoint import write_checkpoint

    f32 = out.with_name(out.name + "-f32")
    write_checkpoint(f32, layers=1, hidden=256, intermediate=512, vocab=vocab, shard_size=1 << 40)
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(str(f32 / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((f32 / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    shutil.rmtree(f32)


def child(ckpt: Path, work: Path, verify: bool, block: str) -> None:
    """The export, in this process (the bench measures it from outside)."""
    from service.checkpoint import open_checkpoint
    from service.config import Settings
    from service.exporters.base import ExportInputs
    from service.exporters.nnef import NNEFExporter, NNEFSpec
    from service.stage import InMemoryContext

    settings = Settings(data_dir=work / "data", nnef_block_bytes=block)
    ctx = InMemoryContext(settings=settings, work_dir=work / "work")
    ctx.work_dir.mkdir(parents=True)
    spec = NNEFSpec(verify=verify, decode_steps=1)
    with open_checkpoint(ckpt) as checkpoint:
        NNEFExporter().export(spec, ExportInputs(checkpoint=checkpoint), work / "out", ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", default="4096,262144,524288")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/nnef-wide"))
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--block-bytes", default="64MiB")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("CKPT", "WORK", "VERIFY", "BLOCK"))
    args = parser.parse_args()
    if args.child:
        ckpt, work, verify, block = args.child
        child(Path(ckpt), Path(work), verify == "1", block)
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        print(f"{'vocab':>8} {'largest f32':>12} {'blocks':>10} {'whole':>10}")
        for vocab in (int(v) for v in args.vocab.split(",")):
            ckpt = args.dir / f"llama-{vocab}"
            write_bf16_llama(ckpt, vocab)
            peaks = []
            for mode, block in (("blocks", args.block_bytes), ("whole", "1TiB")):
                work = args.dir / f"run-{vocab}-{mode}"
                argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(ckpt),
                        str(work), "1" if args.verify else "0", block]  # fmt: skip
                result = run_measured(argv, args.dir / f"{vocab}-{mode}.log", cwd=ROOT)
                if result["exit"] != 0:
                    raise SystemExit(f"export failed: see {args.dir / f'{vocab}-{mode}.log'}")
                peaks.append(result["peak_rss"] >> 20)
                shutil.rmtree(work)
            largest = vocab * 256 * 4 >> 20
            print(f"{vocab:>8} {largest:>8} MiB {peaks[0]:>6} MiB {peaks[1]:>6} MiB", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
