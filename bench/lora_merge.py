"""Peak RSS of a job that merges a LoRA adapter against the same job without one.

Real SmolLM2 (``tests/fixtures/real_models.py``) at two sizes (its first 2 layers, and all 30),
a PEFT adapter with non-zero factors on q/v/o/down_proj (r 8, ``tests/fixtures/lora.py``), one
safetensors bf16 export with verify on; each job in a fresh process (``run_pipeline``, as a
worker runs it), reporting the job process's peak RSS (``getrusage``'s ``ru_maxrss``).

    .venv/bin/python bench/lora_merge.py

The merge must not move the bound: the reader adds the adapter's factors (a few MB) and one
row range of the merged weight at a time, never a whole model. Measured on 2 cores (2026-11-25):

    SmolLM2 2 layers   plain  822 MiB   with adapter  849 MiB
    SmolLM2 30 layers  plain 1648 MiB   with adapter 1625 MiB

Both peaks are the job's independent reference (transformers' whole model in float32, merged
by PEFT for the adapter job), not the merge; about 5 min for the four jobs.
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
request = {"source": source.as_uri(), "exports": [{"format": "safetensors", "dtype": "bfloat16"}]}
if adapter:
    request["adapter"] = Path(adapter).as_uri()
run_pipeline(JobSpec.model_validate(request), ctx, layout)
import resource
print(json.dumps({"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def main() -> None:
    from tests.fixtures.lora import peft_adapter
    from tests.fixtures.real_models import Variant, real_variant

    print(f"{'model':<22}{'adapter':<9}{'job peak RSS (MiB)':>20}")
    for layers in (2, None):
        source = real_variant("smollm2", Variant(layers=layers))
        with tempfile.TemporaryDirectory() as tmp:
            adapter = peft_adapter(source, Path(tmp) / "adapter")
            for with_adapter in (False, True):
                work = Path(tmp) / f"job-{with_adapter}"
                out = subprocess.run(
                    [sys.executable, "-c", JOB, str(source), str(adapter) if with_adapter else "",
                     str(work)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_kib"] / 1024
                label = f"SmolLM2 {layers or 30} layers"
                print(f"{label:<22}{'yes' if with_adapter else 'no':<9}{peak:>20.0f}", flush=True)


if __name__ == "__main__":
    main()
