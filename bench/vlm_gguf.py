"""Peak RSS of a VLM's GGUF job (text model + mmproj projector) against its text model alone.

A tiny-config Gemma 3 (``tests/fixtures/vlm.py``, random weights) at two sizes, and the same
checkpoint's language model saved alone as ``Gemma3ForCausalLM``; one f16 GGUF export per job,
each job in a fresh process (``run_pipeline``, as a worker runs it), reporting the job
process's peak RSS (``getrusage``'s ``ru_maxrss``). ``verify: false`` measures the writer (the
bound: the projector streams through the same writer in row blocks, so the VLM's peak must stay
the text model's, whatever the tower's size); ``verify: true`` adds the read-back and, for the
VLM, the llama-mtmd-cli check, whose transformers reference loads the whole VLM in float32.

    .venv/bin/python bench/vlm_gguf.py

Measured on 2 cores shared with other jobs (2026-11-25), f16:

    size   model      weights MiB  peak MiB  verified peak MiB  mtmd tokens
    small  text only          4.2       415                428            -
    small  vlm                8.7       417                445           16
    large  text only        201.3      1834               1834            -
    large  vlm              719.0      1834               1834           16

The projector adds nothing to the writer's peak at either size (the large tower is 518 MiB, 2.6x
the text model): the bound is the text model's formula. The small VLM's verified peak is 17 MiB
above its text model's: the mtmd check's transformers reference holds the whole VLM in float32
(not layer by layer yet). About 6 min for the eight jobs.
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
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
source, work, verify = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
settings = Settings(data_dir=work / "data", local_roots=[source.parent])
layout = JobLayout.for_job(settings, "e" * 32)
layout.prepare()
ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="e" * 32)
request = {"source": source.as_uri(), "verify": verify,
           "exports": [{"format": "gguf", "type": "f16"}]}
run_pipeline(JobSpec.model_validate(request), ctx, layout)
manifest = json.loads((layout.artifacts / "manifest.json").read_text())
mmproj = manifest["exports"][0].get("mmproj", {})
print(json.dumps({"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "mtmd": mmproj.get("mtmd", {}).get("agreed_tokens")}))
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


def peak(source: Path, work: Path, verify: bool) -> tuple[int, object]:
    run = subprocess.run(
        [sys.executable, "-c", JOB, str(source), str(work), "1" if verify else "0"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"job on {source} failed: {run.stderr[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return int(result["peak_rss_kib"]) >> 10, result["mtmd"]


def main() -> None:
    from tests.fixtures.vlm import write_tiny_gemma3

    print(f"{'size':<7}{'model':<12}{'weights MiB':>12}{'peak MiB':>10}{'verified peak MiB':>19}"
          f"{'mtmd tokens':>13}")  # fmt: skip
    for size, dims in SIZES.items():
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            root = Path(tmp) / "models"
            vlm = root / "vlm"
            summary = write_tiny_gemma3(vlm, **dims)  # type: ignore[arg-type]
            text_bytes = text_only(vlm, root / "text")
            for name, source, nbytes in (
                ("text only", root / "text", text_bytes),
                ("vlm", vlm, summary["total_bytes"]),
            ):
                plain, _ = peak(source, Path(tmp) / f"job-{name}-0", False)
                verified, mtmd = peak(source, Path(tmp) / f"job-{name}-1", True)
                print(f"{size:<7}{name:<12}{nbytes / 2**20:>12.1f}{plain:>10}{verified:>19}"
                      f"{mtmd if mtmd is not None else '-':>13}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
