"""Real models x layouts x exports, each artifact checked by its real consumer: one table.

    .venv/bin/python bench/real_models.py [--quick]

Every row is one job of the service's own pipeline (``run_pipeline``, a ``file://`` source from
``tests/fixtures/real_models.py``) in a child process, so its wall time and peak RSS (``wait4``)
are the job's alone; the consumer check then runs here, on the job's artifacts:

* gguf         llama.cpp: ``llama-tokenize`` ids of the probe set == the HF tokenizer's, and
               ``llama-simple`` greedy continuation == transformers' (f16 export)
* safetensors  transformers reload; the job's own parity check against the source
* nnef         tract (in the job's child): argmax agreed with PyTorch at every decode step, and
               that decode == transformers' argmax loop on the same prompt

* onnx         onnxruntime: the job's own decode check, and a fresh session's greedy decode ==
               transformers' argmax loop

``--quick`` drops the layout rows (the base models only); ``--models a,b`` keeps those models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXPORTS: dict[str, dict[str, Any]] = {
    "gguf": {"format": "gguf", "type": "f16"},
    "safetensors": {"format": "safetensors"},
    "nnef": {"format": "nnef"},
    "onnx": {"format": "onnx"},
}


def rows(quick: bool) -> list[tuple[str, str | None, str]]:
    """(model, variant label or None for the base checkpoint, export)."""
    from tests.fixtures.real_models import COVERING_VARIANTS

    out: list[tuple[str, str | None, str]] = [
        ("smollm2", None, "gguf"),
        ("qwen2", None, "gguf"),
        ("gemma3", None, "safetensors"),
        ("gemma3", None, "nnef"),
        ("minilm", None, "safetensors"),
        ("minilm", None, "nnef"),
        ("smollm2", None, "nnef"),
        ("smollm2", None, "onnx"),
        ("qwen2", None, "onnx"),
        ("minilm", None, "onnx"),
    ]
    if not quick:
        for variant in COVERING_VARIANTS:
            for export in ("safetensors", "gguf", "nnef", "onnx"):
                out.append(("smollm2", variant.label() + "-L4", export))
    return out


def source_dir(model: str, label: str | None) -> Path:
    from tests.fixtures.real_models import COVERING_VARIANTS, Variant, real_model, real_variant

    if label is None:
        return real_model(model)
    for variant in COVERING_VARIANTS:
        if label == variant.label() + "-L4":
            return real_variant(model, Variant(**{**variant.__dict__, "layers": 4}))
    raise SystemExit(f"unknown layout {label}")


def child(model: str, label: str | None, export: str, out: Path) -> None:
    """Run one job; print where its artifacts and manifest are."""
    from service.config import Settings
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    source = source_dir(model, label)
    settings = Settings(data_dir=out / "var", local_roots=[source.parent])
    layout = JobLayout.for_job(settings, "b" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="b" * 32)
    body = dict(EXPORTS[export])
    if export == "nnef" and model != "minilm":
        body["decode_steps"] = 4
    spec = JobSpec.model_validate({"source": f"file://{source}", "exports": [body]})
    run_pipeline(spec, ctx, layout)
    print(json.dumps({"artifacts": str(layout.artifacts), "source": str(source)}))


def consumer_check(model: str, export: str, artifacts: Path, source: Path, work: Path) -> str:
    """What the real consumer said, in a few words; raises AssertionError on a mismatch."""
    from tests.integration.real_models import test_consumers as t

    manifest = json.loads((artifacts / "manifest.json").read_text())
    summary = manifest["exports"][0]
    if export == "gguf":
        from transformers import AutoTokenizer

        (gguf_file,) = (artifacts / "gguf").glob("*.gguf")
        tok = AutoTokenizer.from_pretrained(source)
        for label, text in t.PROBES.items():
            got = t.llama_tokenize(gguf_file, text, work)
            assert got == tok(text, add_special_tokens=False).input_ids, label
        _, hf_text = t.hf_greedy(source, t.PROMPT, t.NEW_TOKENS)
        t.assert_same_continuation(t.llama_greedy(gguf_file, t.PROMPT, t.NEW_TOKENS), hf_text)
        return f"llama.cpp: {len(t.PROBES)} probes same ids, {t.NEW_TOKENS} greedy tokens same"
    if export == "safetensors":
        verify = summary["verify"]
        assert verify["passed"], verify
        return f"transformers reload: max rel err {verify.get('max_rel_error', 0):.2g}"
    if export == "onnx":
        verify = summary["verify"]
        assert verify["max_abs_err"] <= verify["tolerance"], verify
        if model == "minilm":
            return f"onnxruntime: max abs err {verify['max_abs_err']:.2g} <= {verify['tolerance']:.2g}"
        import torch
        from transformers import AutoModelForCausalLM

        from tests.integration.exporters.test_onnx import _decode_in_ort

        prompt, steps = [11, 400, 1234, 77], 4
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(steps):
                ids = torch.cat([ids, lm(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert _decode_in_ort(artifacts / "onnx" / "model.onnx", prompt, steps) == ids[
            0, len(prompt) :
        ].tolist()
        return f"onnxruntime: {steps} greedy tokens == transformers"
    verify = summary["verify"]
    assert verify["max_abs_err"] <= verify["tolerance"], verify
    if model == "minilm":
        return f"tract: max abs err {verify['max_abs_err']:.2g} <= {verify['tolerance']:.2g}"
    t.assert_tract_decoded_like_transformers(source, verify)
    return f"tract: {len(verify['tokens'])} greedy tokens == transformers"


def measure(model: str, label: str | None, export: str, base: Path) -> dict[str, Any]:
    out = base / f"{model}-{label}-{export}"
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", model, label or "base", export, str(out)]
    env = dict(os.environ, TMPDIR=str(out), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.monotonic()
    log = out / "child.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sink, env=env)
        assert proc.stdout is not None
        stdout = proc.stdout.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
    row: dict[str, Any] = {
        "model": model, "layout": label or "as published (bf16)", "export": export,
        "wall_s": round(time.monotonic() - start, 1),
        "peak_rss_mib": usage.ru_maxrss // 1024,
    }  # fmt: skip
    if os.waitstatus_to_exitcode(status) != 0:
        row.update(check="-", result="JOB FAILED: " + log.read_text()[-300:].strip().splitlines()[-1])
        return row
    where = json.loads(stdout.strip().splitlines()[-1])
    # The check loads models too: in a child of its own, or every later job child would
    # inherit this process's peak RSS (Linux keeps ru_maxrss across fork and exec).
    check = subprocess.run(
        [sys.executable, __file__, "--check", model, export, where["artifacts"], where["source"],
         str(out)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    lines = check.stdout.strip().splitlines()
    if check.returncode == 0 and lines:
        row.update(check=lines[-1], result="ok")
    else:
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        row.update(check="-", result=f"CHECK FAILED: {last[:200]}")
    shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", help="only these models (comma-separated)")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "LAYOUT", "EXPORT", "OUT"))
    parser.add_argument("--check", nargs=5, metavar=("MODEL", "EXPORT", "ARTS", "SRC", "WORK"))
    args = parser.parse_args()
    if args.check:
        model, export, artifacts, source, work = args.check
        print(consumer_check(model, export, Path(artifacts), Path(source), Path(work)))
        return
    if args.child:
        model, label, export, out = args.child
        child(model, None if label == "base" else label, export, Path(out))
        return
    cols = ("model", "layout", "export", "check", "result", "wall_s", "peak_rss_mib")
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        for model, label, export in rows(args.quick):
            if args.models and model not in args.models.split(","):
                continue
            row = measure(model, label, export, Path(tmp))
            print(" | ".join(str(row[c]) for c in cols), flush=True)


if __name__ == "__main__":
    main()
