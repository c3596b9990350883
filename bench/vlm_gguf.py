"""Peak RSS of a VLM's GGUF job (text model + mmproj projector) against its text model alone,
next to the plan's prediction.

A tiny-config Gemma 3 (``tests/fixtures/vlm.py``, random float32 weights) at two sizes, and the
same checkpoint's language model saved alone as ``Gemma3ForCausalLM``; one f16 GGUF export per
job, each job in a fresh process (``run_pipeline``, as a worker runs it), reporting the job
process's peak RSS (``getrusage``'s ``ru_maxrss``), the plan's ``job_peak_rss_bytes`` for the
same request (``service.jobs.planning.plan_spec``), the largest child's peak and the plan's
largest child. ``verify: false`` measures the writer; ``verify: true`` adds the read-back and,
for the VLM, the llama-mtmd-cli check.

    .venv/bin/python bench/vlm_gguf.py

The formula (``service.exporters.gguf.plan.plan_gguf`` and ``_plan_vlm``), the same for a VLM as for
its text model: the job's peak is B + G + blocks x C + T (the writer's row blocks; the
projector streams through the same writer, so the tower adds no term); verified in an
unquantized type, a VLM's job also holds the mtmd check's transformers reference, B + 64 MiB +
1.7 x float32 weights of the whole VLM (whatever ``max_memory``), and runs llama-mtmd-cli
(``_mtmd_peak``: 20 MiB + the family's vision workspace + the text file it maps + the projector
it loads + its KV cache and activations). ``mtmd peak/plan`` is the tool's own ``VmHWM``
(``mmproj.mtmd.peak_rss_bytes``); ``child peak/plan`` is the job's
``getrusage(RUSAGE_CHILDREN)``, which counts the job's pages at each fork, against the plan's
largest child.

Measured on 2 cores shared with other jobs (2026-11-27, load ~4), f16, MiB, measured/planned:

    size   model       weights  peak/plan  verified peak/plan  child peak/plan  mtmd peak/plan  mtmd
    small  text only       4.2   419/510             430/511          430/66                 -     -
    small  vlm             8.7   421/510             449/511          427/27             24/27    16
    large  text only     201.3   441/520             644/681          644/164                -     -
    large  vlm           719.0   448/524            1211/1686         630/392          385/392    16

Unverified, the VLM's peak is its text model's at both sizes (+2 and +7 MiB; the large tower is
518 MiB, 2.6x the text model), within the writer's formula. Verified, the large VLM holds the
mtmd reference: 1211 MiB measured, 1686 planned (the 1.7 factor is the text reference's; the
whole VLM measured 1.1 x its float32 weights over the base here, so the plan is on the safe
side). llama-mtmd-cli: 24/27 and 385/392 MiB (before, wait4's 425 and 625 MiB were the job's
RSS at fork, against 164 and 519 planned). The checkpoints are built in a child process
(:data:`BUILD`): built here, their tensors were resident at every job's fork and every job's
peak read 1833 MiB. About 11 min for the eight jobs at that load.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

JOB = """
import json, resource, sys
from pathlib import Path
from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.planning import plan_spec, source_headers
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
source, work, verify = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
settings = Settings(data_dir=work / "data", local_roots=[source.parent])
layout = JobLayout.for_job(settings, "e" * 32)
layout.prepare()
ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="e" * 32)
request = {"source": source.as_uri(), "verify": verify,
           "exports": [{"format": "gguf", "type": "f16"}]}
spec = JobSpec.model_validate(request)
(plan,) = plan_spec(spec, source_headers(spec, settings), settings).exports
run_pipeline(spec, ctx, layout)
manifest = json.loads((layout.artifacts / "manifest.json").read_text())
mmproj = manifest["exports"][0].get("mmproj", {})
print(json.dumps({"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "planned": plan.job_peak_rss_bytes,
                  "child_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "child_planned": max((c.peak_rss_bytes for c in plan.children), default=0),
                  "mtmd": mmproj.get("mtmd", {}).get("agreed_tokens"),
                  "mtmd_bytes": mmproj.get("mtmd", {}).get("peak_rss_bytes"),
                  "mtmd_planned": sum(c.peak_rss_bytes for c in plan.children
                                      if c.name == "llama-mtmd-cli")}))
"""

SIZES = {
    "small": {"hidden": 256, "vision_hidden": 256, "text_layers": 2, "vision_layers": 2},
    "large": {"hidden": 1024, "vision_hidden": 1024, "text_layers": 8, "vision_layers": 16},
}


def text_only(vlm: Path, out: Path) -> int:
    """The VLM's language model saved alone as Gemma3ForCausalLM; returns its bytes."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(vlm / "model.safetensors")
    text = {
        "model." + k.removeprefix("language_model.model."): v
        for k, v in weights.items()
        if k.startswith("language_model.model.")
    }
    text["lm_head.weight"] = weights["language_model.lm_head.weight"]
    save_file(text, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((vlm / "config.json").read_text())["text_config"]
    config["architectures"] = ["Gemma3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vlm / name, out / name)
    return sum(v.numel() * v.element_size() for v in text.values())


def peak(source: Path, work: Path, verify: bool) -> dict[str, object]:
    """One job in a fresh process: its peak and the plan's, in MiB, and the mtmd tokens."""
    run = subprocess.run(
        [sys.executable, "-c", JOB, str(source), str(work), "1" if verify else "0"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"job on {source} failed: {run.stderr[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return {
        "peak": int(result["peak_rss_kib"]) >> 10,
        "planned": int(result["planned"]) >> 20,
        "child": int(result["child_kib"]) >> 10,
        "child_planned": int(result["child_planned"]) >> 20,
        "mtmd": result["mtmd"],
        "mtmd_peak": int(result["mtmd_bytes"] or 0) >> 20,
        "mtmd_planned": int(result["mtmd_planned"]) >> 20,
    }


BUILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.vlm_gguf import text_only
from tests.fixtures.vlm import write_tiny_gemma3
root = Path(sys.argv[2])
summary = write_tiny_gemma3(root / "vlm", **json.loads(sys.argv[3]))
print(json.dumps({"vlm": summary["total_bytes"], "text": text_only(root / "vlm", root / "text")}))
"""
"""Builds both checkpoints in a child: a job started from this process would otherwise count
the fixture's tensors, resident here at the fork, in its ``ru_maxrss`` (Linux keeps the
pre-``exec`` image's high-water mark)."""


def build(root: Path, dims: dict[str, int]) -> dict[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", BUILD, str(Path(__file__).resolve().parents[1]), str(root),
         json.dumps(dims)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return {k: int(v) for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    print(f"{'size':<7}{'model':<11}{'weights':>8}{'peak/plan':>11}{'verified peak/plan':>20}"
          f"{'child peak/plan':>17}{'mtmd peak/plan':>16}{'mtmd':>6}   (MiB)")  # fmt: skip
    for size, dims in SIZES.items():
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            root = Path(tmp) / "models"
            sizes = build(root, dims)
            for name, source, nbytes in (
                ("text only", root / "text", sizes["text"]),
                ("vlm", root / "vlm", sizes["vlm"]),
            ):
                plain = peak(source, Path(tmp) / f"job-{name}-0", False)
                checked = peak(source, Path(tmp) / f"job-{name}-1", True)
                mtmd = checked["mtmd"] if checked["mtmd"] is not None else "-"
                tool = (f"{checked['mtmd_peak']}/{checked['mtmd_planned']}"
                        if checked["mtmd"] is not None else "-")  # fmt: skip
                print(f"{size:<7}{name:<11}{nbytes / 2**20:>8.1f}"
                      f"{plain['peak']:>6}/{plain['planned']:<4}"
                      f"{checked['peak']:>15}/{checked['planned']:<4}"
                      f"{checked['child']:>12}/{checked['child_planned']:<4}{tool:>16}{mtmd:>6}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
