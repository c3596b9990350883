"""Benchmark: tract checking one NNEF archive whole, then block by block.

    .venv/bin/python bench/nnef_layerwise.py CHECKPOINT_DIR [--dir /tmp/nnef-layerwise]
                                             [--steps 2] [--keep] [--block-bytes N]

Exports CHECKPOINT_DIR (a causal LM) to NNEF without verification, records PyTorch's greedy
decode with every layer's output (weights streamed), then runs the archive in tract both ways
(:func:`service.exporters.nnef.verify.verify_causal_lm`,
:func:`service.exporters.nnef.layerwise.verify_causal_lm_layerwise`) within the export's own
tolerance, and prints each one's wall time, tract's peak RSS, the logits' max abs error and,
layer by layer, the largest block's peak. With ``--block-bytes``, a third run cuts the layers
below that block (``MODELPREP_TRACT_BLOCK_BYTES``: attention, MLP, a matrix's rows) and prints
its largest block's weights and peak. tract's whole peak is read from ``wait4`` (it counts
the job's resident memory at the fork); the block-by-block peaks are the child's own ``VmHWM``.

Run of 2026-11-25 on real SmolLM2-135M's first 8 layers in float16 (108 MiB archive; variant
tie=output, v4 keys, layers=8 of ``tests/fixtures/real_models.py``), 2 cores at load ~20::

    whole        7.6 s  tract peak    559 MiB  logits max abs err 0.0625 (tolerance 1.41)
    layerwise   25.0 s  tract peak    168 MiB  logits max abs err 0.0312 (tolerance 1.41)
                blocks 9: layer peak 60-112 MiB, head 168 MiB

The whole figure is ``wait4``'s, which counts this process's image at the fork; tract's own
peak, run alone under ``/usr/bin/time`` on the 4-layer archive (85 MiB), is 206 MiB whole
against 161 MiB block by block. At this size the head block (the tied 54 MiB embedding, packed
for the matmul) sets the layerwise peak, so the saving is small; it grows with the layer stack,
which layerwise never holds at once (the plan: 64 MiB + 1.35 x archive against 64 MiB + 2 x
the largest block).

Run of 2026-11-28, below a layer (``--block-bytes 4194304``) on random 1-layer float32 Llamas
(``save_random_causal_lm``, intermediate 4 x hidden, vocabulary 2048), 2 cores shared::

    hidden  768 (44 MiB):  whole 128 MiB, layer blocks 116 MiB, 4 MiB blocks  73 MiB (10 blocks)
    hidden 1536 (152 MiB): whole 263 MiB, layer blocks 255 MiB, 4 MiB blocks  83 MiB (12 blocks)

The same logits max abs error below a layer as with layer blocks (7.63e-06, 2.67e-05), and the
peak stays near the plan's 64 MiB + 2 x 4 MiB as the layer grows 4x (the rest: activations).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.exporters.base import ExportInputs
from service.exporters.common.offloaded_model import offloaded_model
from service.exporters.nnef import NNEFExporter, NNEFSpec
from service.exporters.nnef.layerwise import verify_causal_lm_layerwise
from service.exporters.nnef.verify import IOSpec, verify_causal_lm
from service.offload.build import build_on_meta
from service.shims.torch_to_nnef import weights_only_unpickling
from service.stage import InMemoryContext
from service.verification.parity import tolerance_for
from service.verification.reference import greedy_reference, prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/nnef-layerwise"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--block-bytes", type=int, default=None)
    args = parser.parse_args()
    root: Path = args.dir
    shutil.rmtree(root, ignore_errors=True)
    (root / "work").mkdir(parents=True)
    ctx = InMemoryContext(settings=Settings(data_dir=root / "data"), work_dir=root / "work")
    try:
        with open_checkpoint(args.checkpoint) as ckpt:
            NNEFExporter().export(
                NNEFSpec(verify=False), ExportInputs(checkpoint=ckpt), root / "out", ctx
            )
            built = offloaded_model(
                build_on_meta(ckpt, Settings()).model, ckpt, offload_dir=root / "offload"
            )
            vocab = int(built.config.vocab_size)
            with weights_only_unpickling():
                expected = greedy_reference(
                    built.module, prompt_ids(4, vocab), args.steps,
                    record_layers=True, record_hidden=True,
                )  # fmt: skip
            tolerance = tolerance_for("runtime", built.dtype)
        archive = root / "out" / "model.nnef.tgz"
        io = IOSpec.from_json(json.loads((root / "out" / "io.json").read_text()))
        print(f"archive {archive.stat().st_size / 2**20:.0f} MiB")
        checks: list[tuple[str, Any]] = [
            ("whole", verify_causal_lm), ("layerwise", verify_causal_lm_layerwise)
        ]
        if args.block_bytes is not None:
            below = functools.partial(verify_causal_lm_layerwise, block_bytes=args.block_bytes)
            checks.append(("below", below))
        for name, check in checks:
            started = time.monotonic()
            report = check(
                archive, io, expected, tolerance.atol, tolerance.rtol, work=root / name
            )
            seconds = time.monotonic() - started
            line = (
                f"{name:9s} {seconds:6.1f} s  tract peak {report.peak_rss_bytes / 2**20:6.0f} MiB"
                f"  logits max abs err {report.max_abs_err:.3g} (tolerance {report.tolerance:.3g})"
            )
            blocks = report.extra.get("blocks")
            if blocks and name == "below":
                heaviest = max(blocks, key=lambda b: b["weight_bytes"])
                line += (
                    f"  blocks {len(blocks)}: largest {heaviest['weight_bytes'] / 2**20:.1f} MiB "
                    f"({heaviest['block']}), peak "
                    f"{max(b['tract_peak_rss_bytes'] for b in blocks) / 2**20:.0f} MiB"
                )
            elif blocks:
                layers = [b["tract_peak_rss_bytes"] for b in blocks[:-1]]
                line += (
                    f"  blocks {len(blocks)}: layer peak {min(layers) / 2**20:.0f}-"
                    f"{max(layers) / 2**20:.0f} MiB, head {blocks[-1]['tract_peak_rss_bytes'] / 2**20:.0f} MiB"
                )
            print(line, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
