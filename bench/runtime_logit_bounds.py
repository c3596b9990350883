"""Calibrate the graph runtimes' logit bounds (``service.verification.logits.RUNTIME_LOGIT_BOUNDS``,
``COMPRESSED_LOGIT_BOUNDS``) on the
real corpus (prints a table).

For each decoder of ``tests/fixtures/real_models.py`` (whole models), jobs export ONNX in
float32 and float16, NNEF in float32 (the bfloat16 checkpoint) and float16 (its float16
variant), NNEF q4_0, and NNEF float32 checked block by block (a tract budget below the whole
archive). Each figure is the job's own: its check of tract's or onnxruntime's logits against
transformers' float32 run of the source on ``service.verification.logits.FIXED_TEXT`` (126 scored
positions), as the manifest's ``verify.logits`` reports it. The bounds are lifted for this
run only (the table is what sets them), so a figure beyond today's bound is printed, not
raised.

    python bench/runtime_logit_bounds.py [smollm2 gemma3 qwen2]
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from service.config import Settings
from service.exporters.nnef.plan import block_weight_bytes, tract_peaks
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
from service.verification import logits
from tests.fixtures.real_models import Variant, real_model, real_variant

ROWS: list[tuple[str, dict[str, Any], bool, bool]] = [
    # (label, export, float16 variant, layer by layer)
    ("onnx float32", {"format": "onnx", "dtype": "float32"}, False, False),
    ("onnx float16", {"format": "onnx", "dtype": "float16"}, False, False),
    ("nnef float32", {"format": "nnef"}, False, False),
    ("nnef float32 layerwise", {"format": "nnef"}, False, True),
    ("nnef float16", {"format": "nnef"}, True, False),
    ("nnef q4_0", {"format": "nnef", "compression": "q4_0"}, False, False),
]


def _job(work: Path, source: Path, export: dict[str, Any], layerwise: bool) -> dict[str, Any]:
    import json

    settings = Settings(data_dir=work / "data", local_roots=[source.parent])
    if layerwise:
        from service.checkpoint.headers import local_file_header

        tensors = [t for f in source.glob("*.safetensors") for t in local_file_header(f)]
        # as the export writes them: float32 (the bfloat16 checkpoint is widened)
        sizes = [(t.name, t.numel * 4) for t in tensors]
        _, blocks = tract_peaks(sum(s for _, s in sizes), block_weight_bytes(sizes))
        settings = settings.model_copy(update={"tract_max_memory": str(blocks)})
    job_id = "b" * 32
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
    spec = JobSpec.model_validate({"source": f"file://{source}", "exports": [export]})
    run_pipeline(spec, ctx, layout)
    manifest: dict[str, Any] = json.loads((layout.artifacts / "manifest.json").read_text())
    return manifest


def main(names: list[str]) -> None:
    lifted = logits.LogitBounds(kl_mean=math.inf, kl_p99=math.inf, top1=0.0, ppl_ratio=math.inf)
    for table in (logits.RUNTIME_LOGIT_BOUNDS, logits.COMPRESSED_LOGIT_BOUNDS):
        for key in list(table):
            table[key] = lifted
    rows = []
    for name in names:
        for label, export, f16, layerwise in ROWS:
            source = real_variant(name, Variant(dtype="float16")) if f16 else real_model(name)
            t = time.time()
            with tempfile.TemporaryDirectory(prefix=f"rt-bounds-{name}-") as tmp:
                try:
                    manifest = _job(Path(tmp), source, export, layerwise)
                except Exception as exc:  # noqa: BLE001 - a bench row that fails is printed
                    print(name, label, "failed:", str(exc)[:300], flush=True)
                    rows.append((name, label, None, ""))
                    continue
            (entry,) = manifest["exports"]
            verify = entry["verify"]
            fig = verify.get("logits")
            rows.append((name, label, fig, verify.get("mode", "")))
            print(name, label, verify.get("mode"), fig, f"{time.time() - t:.0f} s", flush=True)
    print("\n| model | export | mode | KL mean | KL p99 | top-1 | PPL ratio |\n|---|---|---|---|---|---|---|")
    for name, label, fig, mode in rows:
        if not fig:
            print(f"| {name} | {label} | {mode} | (no figures) | | | |")
            continue
        print(f"| {name} | {label} | {fig.get('mode', mode)} | {fig['kl_mean']:.2e} | "
              f"{fig['kl_p99']:.2e} | {fig['top1']:.4f} | {fig['ppl_ratio']:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2", "gemma3", "qwen2"])
