"""Calibrate the per-type logit bounds of the GGUF check on the real corpus (prints a table).

For each decoder of ``tests/fixtures/real_models.py`` (SmolLM2, Qwen2.5, Gemma 3; whole models),
one job exports GGUF f16, bf16, q8_0 and q4_0 (and Q4_K_M for comparison); each file is judged by
``llama-perplexity --kl-divergence`` against base logits of transformers' float32 run of the
source on ``service.verification.logits.FIXED_TEXT`` (2 chunks of 128 tokens: 126 scored positions).

    python bench/logit_bounds.py [smollm2 qwen2 gemma3]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from service.shims.llama_cpp import llama_cpp_tool
from service.verification.independent import independent_reference
from service.verification.llama_kl import parse_llama_kl, write_llama_base_logits
from service.verification.logits import FIXED_TEXT
from tests.fixtures.real_models import real_model
from tests.integration.real_models.test_consumers import run_job

TYPES = ["f16", "bf16", "q8_0", "q4_0", "Q4_K_M"]


def main(names: list[str]) -> None:
    rows = []
    for name in names:
        source = real_model(name)
        with tempfile.TemporaryDirectory(prefix=f"bounds-{name}-") as tmp:
            work = Path(tmp)
            t = time.time()
            config = AutoConfig.from_pretrained(source)
            cls = getattr(transformers, config.architectures[0])
            ids = torch.zeros((1, 8), dtype=torch.long)
            ref = independent_reference(source, cls, ids, FIXED_TEXT, 1 << 40, work / "ref")
            assert ref.chunks is not None
            base = work / "base.logits"
            write_llama_base_logits(base, ref.chunks, ref.vocab_size, ref.chunk_logits())
            exports = [{"format": "gguf", "type": t, "verify": False} for t in TYPES]
            artifacts, manifest = run_job(work / "job", source, exports)
            for export in manifest["exports"]:
                gguf = next((artifacts / export["dir"]).glob("*.gguf"))
                out = subprocess.run(
                    [str(llama_cpp_tool("llama-perplexity")), "-m", str(gguf),
                     "--kl-divergence-base", str(base), "--kl-divergence",
                     "-c", str(ref.chunks.shape[1]), "-b", str(ref.chunks.shape[1]), "-t", "2"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                fig = parse_llama_kl(out.stdout + out.stderr, 126)
                rows.append((name, export["spec"]["type"], fig))
                print(name, export["spec"]["type"], fig, flush=True)
            print(f"{name}: {time.time() - t:.0f} s", flush=True)
    print("\n| model | type | KL mean | KL p99 | top-1 | PPL ratio |\n|---|---|---|---|---|---|")
    for name, type_name, fig in rows:
        if fig is None:
            print(f"| {name} | {type_name} | (no figures) | | | |")
            continue
        print(f"| {name} | {type_name} | {fig.kl_mean:.5f} | {fig.kl_p99:.5f} | {fig.top1:.4f} | "
              f"{fig.ppl_ratio:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2", "qwen2", "gemma3"])
