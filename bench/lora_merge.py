"""Peak RSS of a GGUF job with a LoRA adapter, merged or kept apart, against the same job
without one.

Real SmolLM2 (``tests/fixtures/real_models.py``) at two sizes (its first 2 layers, and all 30),
a PEFT adapter with non-zero factors on q/v/o/down_proj (r 8, ``tests/fixtures/lora.py``), one
f16 GGUF export with verify on (llama.cpp's logits check against transformers, PEFT-merged for
the merged job); ``unmerged`` is ``"merge": false`` with ``"lora": true`` (the base GGUF plus a
GGUF LoRA, checked by llama.cpp ``--lora`` against PEFT's ``PeftModel``). Each job runs in a
fresh process (``run_pipeline``, as a worker runs it), reporting its peak RSS (``getrusage``'s
``ru_maxrss``) beside the job's plan (``plan_spec``'s ``peak_rss_bytes``: the same formula with
or without an adapter).

    .venv/bin/python bench/lora_merge.py

The adapter must not move the bound: the reader adds the adapter's factors (a few MB) and one
row range of the merged weight at a time, never a whole model; kept apart, the GGUF LoRA is the
adapter's size and its reference is transformers' run like the plain job's. Measured on 2 cores
shared with other jobs (2026-11-25):

    model              adapter   job peak RSS (MiB)  plan bound (MiB)
    SmolLM2 2 layers   no                       725               694
    SmolLM2 2 layers   merged                   736               694
    SmolLM2 2 layers   unmerged                 725               694
    SmolLM2 30 layers  no                      1181              1336
    SmolLM2 30 layers  merged                  1221              1336
    SmolLM2 30 layers  unmerged                1235              1336

(an earlier run on a busier machine gave 930 for both 2-layer jobs, plain and merged.) The
adapter moves the peak by at most 11 MiB (2 layers) and 54 MiB (30 layers, 4.6 %); every
30-layer job stays under the plan. At 2 layers the plain job already exceeds the plan by
31 MiB (4.5 %), so the adapter is not what the plan misses there. About 8 min for the six jobs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

JOB = """
import json, sys
from pathlib import Path
from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
source, adapter, work = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
settings = Settings(data_dir=work / "data", local_roots=[source.parent, work.parent])
layout = JobLayout.for_job(settings, "c" * 32)
layout.prepare()
ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="c" * 32)
mode = sys.argv[4]
request = {"source": source.as_uri(), "exports": [{"format": "gguf", "type": "f16"}]}
if mode != "no":
    request["adapter"] = Path(adapter).as_uri()
if mode == "unmerged":
    request["merge"] = False
    request["exports"] = [{"format": "gguf", "type": "f16", "lora": True}]
spec = JobSpec.model_validate(request)
from service.jobs.planning import plan_spec, source_headers
plan = plan_spec(spec, source_headers(spec, settings), settings)
run_pipeline(spec, ctx, layout)
import resource
print(json.dumps({"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "planned_peak_rss": plan.peak_rss_bytes}))
"""


def main() -> None:
    from tests.fixtures.lora import peft_adapter
    from tests.fixtures.real_models import Variant, real_variant

    print(f"{'model':<22}{'adapter':<10}{'job peak RSS (MiB)':>20}{'plan bound (MiB)':>18}")
    for layers in (2, None):
        source = real_variant("smollm2", Variant(layers=layers))
        with tempfile.TemporaryDirectory() as tmp:
            adapter = peft_adapter(source, Path(tmp) / "adapter")
            for mode in ("no", "merged", "unmerged"):
                work = Path(tmp) / f"job-{mode}"
                out = subprocess.run(
                    [sys.executable, "-c", JOB, str(source), str(adapter), str(work), mode],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                found = json.loads(out.stdout.strip().splitlines()[-1])
                peak = found["peak_rss_kib"] / 1024
                bound = found["planned_peak_rss"] / 2**20
                label = f"SmolLM2 {layers or 30} layers"
                print(f"{label:<22}{mode:<10}{peak:>20.0f}{bound:>18.0f}", flush=True)


if __name__ == "__main__":
    main()
