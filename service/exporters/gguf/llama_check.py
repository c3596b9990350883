"""The written GGUF checked by llama.cpp itself: tokenization and perplexity, in child processes.

Reading our own file back (``verify.verify_gguf``) proves the weights are the source's; it
cannot prove llama.cpp understands the file the same way. So the job runs llama.cpp's tools on
it: ``llama-tokenize`` on a fixed probe set must give the Hugging Face tokenizer's ids exactly (a
wrong ``tokenizer.ggml.pre`` or vocabulary shows up here), and ``llama-perplexity`` on a short
fixed text gives the perplexity of the quantized file and of the f16 it was made from; their
ratio beyond the type's bound (:data:`PPL_RATIO_BOUND`) fails the job. Each tool runs as a child
(its model memory is its own and is returned when it exits; a cancel kills it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import QualityBelowThreshold, VerificationFailed
from service.exporters.common.child_process import ChildPeaks, run_child
from service.shims.llama_cpp import TOOL_ENV, llama_cpp_tool
from service.verification.llama_kl import parse_llama_kl, write_llama_base_logits
from service.verification.logits import FIXED_TEXT, LogitBounds, LogitFigures
from service.verification.quality import (
    DEFAULT_MIN_DECIDED_TOP1,
    default_violation,
    reference_margins,
    requested_violations,
)

if TYPE_CHECKING:
    from service.verification.independent import IndependentReference
    from service.verification.thresholds import QualityThresholds

PROBES = (
    "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog, 1234567890 times.",
    "inner  double spaces,\ttabs\nand newlines\n\n",
    "Ünïcödé: éàü ß 中文 日本語 한국어 🙂",
    "def add(a, b):\n    return a + b  # code",
    "It's 3.14 — isn't it? I'll, we've, they're.",
)
"""Texts whose tokenization differs between pre-tokenizers (digits, spaces, contractions, CJK).
None starts with a space: there transformers' SentencePiece tokenizers and sentencepiece itself
(which llama.cpp follows) already disagree, whatever the GGUF says."""

PPL_TEXT = FIXED_TEXT
"""Fixed text for llama-perplexity when the request gives none (``verify_text``)."""

PPL_CTX = 128
"""Context of each perplexity chunk: short, so the text makes several chunks and it stays fast."""

PPL_RATIO_BOUND: dict[str, float] = {
    "Q2_K": 3.0,
    "Q3_K_S": 2.0,
    "Q3_K_M": 1.6,
    "Q3_K_L": 1.5,
    "IQ4_NL": 1.3,
    "IQ4_XS": 1.3,
    "Q4_K_S": 1.3,
    "Q4_K_M": 1.25,
    "Q5_K_S": 1.12,
    "Q5_K_M": 1.1,
    "Q6_K": 1.05,
}
"""Largest perplexity(quantized) / perplexity(f16) accepted per type. Loose on purpose: models
of ~100M parameters (what the test corpus holds) lose far more to quantization than the 8B
figures llama-quantize prints; a broken file lands orders of magnitude beyond these."""

_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+(?:e[+-]?\d+)?|nan|inf)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")
_RUNNING = re.compile(r"\[(\d+)\]([0-9.]+(?:e[+-]?\d+)?|nan|inf),")
_ATTEMPTS = 8
"""The pinned llama.cpp leaks its logger on exit (upstream issue 22142): the last lines it
queued can be lost although the tool succeeded. The running estimate after the last chunk is
the final one, so either line will do; when both were lost the tool is run again. The KL
summary has no such second copy, and on a busy machine three runs in a row lost it (a 2-core
CI run): eight runs of a check that takes seconds are cheap next to a job failed for nothing."""


def _tool_output(
    argv: list[str], work: Path, what: str, check_abort: Callable[[], None]
) -> tuple[str, ChildPeaks]:
    log = work / f"{what}.log"
    peaks = run_child(argv, work, what, check_abort, TOOL_ENV, log=log, timeout=3600.0)
    return log.read_text("utf-8", "replace"), peaks


def llama_tokenize(
    gguf_path: Path,
    texts: tuple[str, ...],
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> list[list[int]]:
    """Token ids llama.cpp gives each text (no BOS, special tokens not parsed)."""
    tool = str(llama_cpp_tool("llama-tokenize", bin_dir))
    out: list[list[int]] = []
    for i, text in enumerate(texts):
        prompt = work / f"probe-{i}.txt"
        prompt.write_text(text, encoding="utf-8")
        argv = [tool, "-m", str(gguf_path), "-f", str(prompt), "--ids", "--no-bos",
                "--no-parse-special", "--log-disable"]  # fmt: skip
        text_out, _ = _tool_output(argv, work, "llama-tokenize", check_abort)
        lines = [ln for ln in text_out.splitlines() if ln.startswith("[")]
        if not lines:
            raise VerificationFailed(f"llama-tokenize printed no ids: {text_out[-300:]}")
        out.append([int(x) for x in json.loads(lines[-1])])
    return out


def check_tokenizer(
    gguf_path: Path,
    checkpoint_root: Path,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> dict[str, Any]:
    """llama.cpp's ids for :data:`PROBES` equal the Hugging Face tokenizer's, or VerificationFailed."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint_root))
    expected = [list(hf.encode(t, add_special_tokens=False)) for t in PROBES]
    got = llama_tokenize(gguf_path, PROBES, work, check_abort, bin_dir)
    prefix = 0
    for text, want, have in zip(PROBES, expected, got, strict=True):
        if want != have and _prefix_space_only(want, have, hf):
            prefix += 1
        elif want != have:
            raise VerificationFailed(
                f"llama.cpp tokenizes {text!r} as {have[:24]} but the checkpoint's tokenizer "
                f"gives {want[:24]}: the GGUF's tokenizer metadata is wrong for this model"
            )
    report = {"probes": len(PROBES), "tokens": sum(map(len, expected)), "match": True}
    return report | ({"prefix_space_differs": prefix} if prefix else {})


def _prefix_space_only(want: list[int], have: list[int], hf: Any) -> bool:
    """Whether the two tokenizations differ only by one leading lone space piece (``▁``): a
    SentencePiece model's prefix space, which transformers' tokenizer class adds or not by its
    own convention (``LlamaTokenizer`` adds it, llama.cpp's Gemma vocabulary does not) whatever
    the vocabulary says; the vocabulary and pre-tokenizer this check is about agree."""
    longer, shorter = (want, have) if len(want) > len(have) else (have, want)
    if len(longer) != len(shorter) + 1 or longer[1:] != shorter:
        return False
    return str(hf.convert_ids_to_tokens(longer[0])) == "\u2581"


def perplexity(
    gguf_path: Path, work: Path, check_abort: Callable[[], None], bin_dir: Path | None = None,
    text_of: str | None = None,
) -> float:
    """llama-perplexity of the file on ``text_of`` (the request's text as
    :func:`~service.verification.logits.check_text` made it), else :data:`PPL_TEXT` (chunks
    of :data:`PPL_CTX` tokens)."""
    body = text_of or PPL_TEXT
    text = work / "perplexity.txt"
    text.write_text(body, encoding="utf-8")
    argv = [str(llama_cpp_tool("llama-perplexity", bin_dir)), "-m", str(gguf_path),
            "-f", str(text), "-c", str(PPL_CTX), "-b", str(PPL_CTX)]  # fmt: skip
    out = ""
    for _ in range(_ATTEMPTS):
        out, _ = _tool_output(argv, work, "llama-perplexity", check_abort)
        estimate = _estimate(out)
        if estimate is not None:
            break
    else:
        raise VerificationFailed(f"llama-perplexity gave no estimate: {out[-300:]}")
    value = float(estimate)
    if not math.isfinite(value):
        raise VerificationFailed(f"llama-perplexity of {gguf_path.name} is {estimate}")
    return value


def _estimate(out: str) -> str | None:
    """The final perplexity in the tool's log: its final line, or the last chunk's running value."""
    found = _PPL.search(out)
    if found is not None:
        return found.group(1)
    chunks = _CHUNKS.search(out)
    running = _RUNNING.findall(out)
    if chunks is not None and running and int(running[-1][0]) == int(chunks.group(1)):
        return str(running[-1][1])
    return None


def check_perplexity(type_name: str, ppl: float, ppl_f16: float) -> dict[str, Any]:
    """The manifest's perplexity section; VerificationFailed beyond the type's ratio bound."""
    bound = PPL_RATIO_BOUND[type_name]
    ratio = ppl / ppl_f16
    if ratio > bound:
        raise VerificationFailed(
            f"{type_name} perplexity {ppl:.3f} is {ratio:.2f}x the f16's {ppl_f16:.3f} "
            f"(bound {bound}x) on the fixed text"
        )
    return {"quantized": ppl, "f16": ppl_f16, "ratio": ratio, "bound": bound, "ctx": PPL_CTX}


CALIBRATED_FIGURES: dict[str, LogitBounds] = {
    "f32": LogitBounds(kl_mean=0.001, kl_p99=0.01, top1=0.97, ppl_ratio=1.02),
    "f16": LogitBounds(kl_mean=0.001, kl_p99=0.01, top1=0.97, ppl_ratio=1.02),
    "bf16": LogitBounds(kl_mean=0.005, kl_p99=0.03, top1=0.95, ppl_ratio=1.03),
    "q8_0": LogitBounds(kl_mean=0.02, kl_p99=0.08, top1=0.9, ppl_ratio=1.06),
    "q4_0": LogitBounds(kl_mean=1.0, kl_p99=6.0, top1=0.5, ppl_ratio=2.0),
    "Q4_K_M": LogitBounds(kl_mean=0.3, kl_p99=1.2, top1=0.7, ppl_ratio=1.3),
}
"""What a correct GGUF of each type shows on a *decisive* model, reported beside the figures
for reading them, never judged: a correct file of a low-margin model breaks them (issue 35: a
std-0.02 Llama's q8_0 agreed on 0.83 of its top-1 tokens). What fails a job is the request's
thresholds and the margin-aware default (:mod:`service.verification.quality`). The figures,
measured by ``bench/logit_bounds.py`` against transformers' float32 run of the source on
:data:`service.verification.logits.FIXED_TEXT` (126 scored positions), each row above the worst
of them: on the whole SmolLM2-135M f16 KL 2e-6 (p99 3e-5), bf16 8e-5 (3e-4), q8_0 0.0037
(0.0099, top-1 0.984), q4_0 0.28 (0.70, top-1 0.66), Q4_K_M 0.057 (0.21, top-1 0.86);
perplexity ratio 0.99-1.08. On the whole Qwen2.5-Coder-0.5B: f16 1.7e-4 (0.0012, top-1 1.0),
bf16 0.0025 (0.017, 0.976), q8_0 0.0044 (0.027, 0.984), q4_0 0.58 (3.58, 0.587), Q4_K_M 0.074
(0.49, 0.841); perplexity ratio 0.79-1.05. On the whole Gemma 3 270M: f16 3e-6 (3e-5, 1.0),
bf16 4.7e-5 (1.5e-4, 1.0), q8_0 0.0022 (0.0060, 0.976), q4_0 0.35 (1.26, 0.603, perplexity
ratio 1.55), Q4_K_M 0.0047 (0.016, 0.929). A file read or written wrong lands at KL ~1-10 with
top-1 near 0 (tests/integration/real_models/test_checks_fail.py)."""
PPL_JUDGED_BELOW = 1000.0
"""The perplexity ratio is judged only when the reference itself predicts the text (its
perplexity below this): llama.cpp keeps base log-probabilities down to max - 16 nats, so on a
model that does not (a few layers of one, in tests) the ratio compares a floor with a value."""
_PPL_BASE = re.compile(r"Mean PPL\(base\)\s*:\s*([-+0-9.eE]+|nan|inf)")


def check_logits(
    gguf_path: Path,
    type_name: str,
    reference: IndependentReference,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
    lora: Path | None = None,
    thresholds: QualityThresholds | None = None,
) -> dict[str, Any]:
    """The GGUF's logits in llama.cpp against transformers' on the fixed text
    (``llama-perplexity --kl-divergence`` over a base file written from the reference): KL
    mean and p99, top-1 agreement, perplexity ratio, and the reference's margins
    (:mod:`service.verification.quality`) with top-1 agreement on decided positions (a second
    run whose base file counts near ties as disagreeing, when some positions are near ties
    and some not). Judged by the request's ``thresholds`` (:class:`QualityBelowThreshold`) and
    the margin-aware default (VerificationFailed: a decided top-1 that flips is a fault, not
    noise). With ``lora``, llama.cpp applies that GGUF LoRA to the file (``--lora``)."""
    assert reference.chunks is not None
    chunks = reference.chunks
    logits = reference.chunk_logits()
    n_vocab = int(logits[0].shape[-1])
    n_ctx = int(chunks.shape[1])
    positions = len(chunks) * (n_ctx // 2 - 1)
    base = work / "reference.logits"
    write_llama_base_logits(base, chunks, n_vocab, logits)
    figures, out, peaks = _kl_run(gguf_path, base, n_ctx, positions, work, check_abort,
                                  bin_dir, lora)  # fmt: skip
    margins = reference_margins(logits, n_ctx, type_name, figures.kl_mean)
    decided_top1: float | None = None
    if margins.decided == margins.positions:
        decided_top1 = figures.top1
    elif margins.decided > 0:
        masked = work / "reference-decided.logits"
        write_llama_base_logits(masked, chunks, n_vocab, logits, excluded=margins.near_tie)
        subset, _, _ = _kl_run(gguf_path, masked, n_ctx, margins.positions, work, check_abort,
                               bin_dir, lora)  # fmt: skip
        decided_top1 = min(1.0, round(subset.top1 * margins.positions) / margins.decided)
    found = _PPL_BASE.findall(out)
    ppl_base = float(found[-1]) if found else math.inf
    calibrated = CALIBRATED_FIGURES.get(type_name)
    report: dict[str, Any] = {
        "reference": reference.summary()["implementation"],
        "text": reference.summary()["text"],
        **figures.as_dict(),
        "decided_top1": decided_top1,
        "margins": margins.summary(),
        "reference_perplexity": ppl_base,
        "thresholds": None if thresholds is None else thresholds.set_thresholds(),
        "default": f"decided_top1 >= {DEFAULT_MIN_DECIDED_TOP1}",
        "calibrated_on_decisive_models": (
            None if calibrated is None else dataclasses.asdict(calibrated)
        ),
        # the tool's own peak RSS (run_child): llama.cpp maps the file, so its pages count
        # there as page cache the kernel can drop; the anonymous peak is what the tool holds
        "llama_cpp_peak_rss_bytes": peaks.rss,
        "llama_cpp_peak_anon_bytes": peaks.anon,
    }
    fault = default_violation(decided_top1, margins)
    if fault is not None:
        raise VerificationFailed(
            f"{type_name} GGUF run by llama.cpp is too far from transformers' run of the source "
            f"on the fixed text: {fault}"
        )
    if thresholds is not None:
        failed = requested_violations(figures, decided_top1, thresholds)
        if not ppl_base < PPL_JUDGED_BELOW:
            failed = [f for f in failed if not f.startswith("perplexity")]
            report["ppl_ratio_judged"] = False
        if failed:
            raise QualityBelowThreshold(
                f"{type_name} GGUF run by llama.cpp is below the requested quality on the fixed "
                f"text: {'; '.join(failed)} (near ties: {margins.positions - margins.decided} "
                f"of {margins.positions} positions)"
            )
    return report


def _kl_run(
    gguf_path: Path,
    base: Path,
    n_ctx: int,
    positions: int,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None,
    lora: Path | None,
) -> tuple[LogitFigures, str, ChildPeaks]:
    """One ``llama-perplexity --kl-divergence`` run over ``base``: its figures, log and peaks."""
    argv = [str(llama_cpp_tool("llama-perplexity", bin_dir)), "-m", str(gguf_path),
            "--kl-divergence-base", str(base), "--kl-divergence",
            "-c", str(n_ctx), "-b", str(n_ctx)]  # fmt: skip
    if lora is not None:
        argv += ["--lora", str(lora)]
    out, peaks = "", ChildPeaks(0, None)
    for _ in range(_ATTEMPTS):
        out, peaks = _tool_output(argv, work, "llama-kl-divergence", check_abort)
        figures = parse_llama_kl(out, positions)
        if figures is not None:
            return figures, out, peaks
    raise VerificationFailed(f"llama-perplexity --kl-divergence gave no figures: {out[-300:]}")
