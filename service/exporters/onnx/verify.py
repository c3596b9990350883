"""Numerical parity of an exported ONNX model run by onnxruntime with the PyTorch model.

onnxruntime runs in a child process (:mod:`service.exporters.onnx.ort_cli`, started through
:func:`service.exporters.common.child_process.run_child`): it reads every weight into RAM, which must
not count against the job process. PyTorch's side runs in the job process on the offloaded copy
of the model (each weight re-read from the store while its op runs), so the reference costs a
pass over the weights, not their sum in memory.

Causal LMs are checked the way they are served: PyTorch decodes greedily with its KV cache;
onnxruntime runs the same prompt with empty ``past_key_values.*``, then each of PyTorch's tokens
with its own ``present.*`` fed back. The logits of every step must agree within
``atol + rtol * max|reference|``, and onnxruntime's argmax must be PyTorch's token at every step
unless PyTorch's own top two logits are closer than the error measured (a tie, not a
divergence). Encoders are run once on a fixed input and ``last_hidden_state`` compared.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import VerificationFailed
from service.exporters.common.child_process import compare_outputs, ensure_fits, run_child
from service.exporters.onnx import ort_cli
from service.logits import LogitBounds, compare_logits, scored

if TYPE_CHECKING:
    from torch import nn

ORT_BASE_BYTES = 256 * 2**20
"""onnxruntime's own footprint (runtime, arena, a short prompt's tensors and KV cache): the
weights are memory-mapped (:mod:`service.exporters.onnx.mapped`), so this does not grow with
the model; 43 MB of anonymous memory was measured on a 2.76 GB Llama."""


@dataclass(frozen=True)
class ParityReport:
    max_abs_err: float
    ref_max_abs: float
    tolerance: float
    compared: int
    """Output vectors compared (decode steps + 1 for an LLM, outputs for an encoder)."""
    tokens: list[int] = field(default_factory=list)
    """PyTorch's greedy tokens (causal LMs)."""
    argmax_agreed: list[bool] = field(default_factory=list)
    """Whether onnxruntime's argmax was PyTorch's token at each step (causal LMs)."""
    ort_peak_rss_bytes: int = 0
    """Peak RSS of the onnxruntime child process, mapped pages of the weights included."""
    ort_peak_anon_bytes: int = 0
    """Peak anonymous memory of that child: what the runtime itself allocated."""
    mode: str = "whole"
    """The whole model in one onnxruntime session."""
    weights: str = "mapped"
    """How onnxruntime holds the weights: memory-mapped from the external data file."""
    logits: dict[str, Any] | None = None
    """onnxruntime's logits on the fixed text against the job's independent reference
    (:func:`check_logits`), causal LMs with a tokenizer."""

    def summary(self) -> dict[str, Any]:
        return asdict(self)


def ensure_ort_fits(weight_bytes: int, setting: str | None) -> None:
    """Refuse up front a verification onnxruntime cannot hold. Its weights are memory-mapped
    (``weight_bytes`` of page cache the kernel reclaims as it needs), so what it needs is its
    own footprint, whatever the model's size."""
    ensure_fits("onnxruntime", ORT_BASE_BYTES, setting, "MODELPREP_ORT_MAX_MEMORY")


@dataclass(frozen=True)
class OrtRun:
    outputs: dict[str, np.ndarray]
    peak_rss_bytes: int
    peak_anon_bytes: int


def run_ort(
    model: Path,
    command: str,
    request: dict[str, np.ndarray],
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> OrtRun:
    """Run ``ort_cli.py MODEL COMMAND`` in a child process and read its outputs."""
    work.mkdir(parents=True, exist_ok=True)
    request_path, outputs_path = work / "request.npz", work / "outputs.npz"
    np.savez(request_path, **request)  # type: ignore[arg-type]
    argv = [
        sys.executable, "-P", str(Path(ort_cli.__file__).resolve()), str(model), command,
        str(request_path), str(outputs_path),
    ]  # fmt: skip
    run_child(argv, work, "onnxruntime", check_abort)
    with np.load(outputs_path) as bundle:
        outputs = {k: bundle[k] for k in bundle.files}
    # The child's own VmHWM: wait4's ru_maxrss would include this process's pages (see ort_cli).
    peak = int(outputs.pop("peak_rss_bytes"))
    return OrtRun(outputs, peak, int(outputs.pop("peak_anon_bytes")))


def verify_causal_lm(
    model_path: Path,
    module: nn.Module,
    prompt_tokens: int,
    decode_steps: int,
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> ParityReport:
    """PyTorch's greedy decode (``module``, a transformers causal LM) replayed in onnxruntime."""
    from service.exporters.nnef.exporter import prompt_ids
    from service.exporters.nnef.verify import greedy_reference

    config: Any = module.config
    prompt = prompt_ids(prompt_tokens, int(config.vocab_size))
    expected = greedy_reference(module, prompt, decode_steps)
    if check_abort is not None:
        check_abort()
    request = {
        "prompt": np.asarray([expected.prompt], dtype=np.int64),
        "tokens": np.asarray(expected.tokens, dtype=np.int64),
    }
    run = run_ort(model_path, "decode", request, work, check_abort)
    found = list(run.outputs["logits"])
    err, ref, tol = compare_outputs("onnxruntime", found, expected.logits, atol, rtol)
    agreed = [int(np.argmax(f)) == t for f, t in zip(found, expected.tokens, strict=True)]
    report = ParityReport(
        err, ref, tol, len(found), expected.tokens, agreed, ort_peak_rss_bytes=run.peak_rss_bytes,
        ort_peak_anon_bytes=run.peak_anon_bytes,
    )
    if err > tol:
        raise VerificationFailed(
            f"onnxruntime logits differ from PyTorch by {err:.3g} (tolerance {tol:.3g}) over "
            f"{len(found)} decode steps"
        )
    for step, (logits, ok) in enumerate(zip(expected.logits, agreed, strict=True)):
        top2 = np.sort(logits.astype(np.float64))[-2:]
        if not ok and float(top2[1] - top2[0]) > 2 * err:
            raise VerificationFailed(
                f"onnxruntime's greedy token differs from PyTorch's at step {step} "
                f"(PyTorch's margin {float(top2[1] - top2[0]):.3g}, error {err:.3g})"
            )
    return report


def verify_encoder(
    model_path: Path,
    module: nn.Module,
    sequence_length: int,
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> ParityReport:
    """One run on a fixed input: onnxruntime's ``last_hidden_state`` vs PyTorch's."""
    import inspect

    import torch

    from service.exporters.nnef.exporter import prompt_ids

    accepted = inspect.signature(module.forward).parameters
    config: Any = module.config
    vocab = int(getattr(config, "vocab_size", 2))
    ids = torch.tensor([prompt_ids(sequence_length, vocab)], dtype=torch.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
    }
    feeds = {k: v for k, v in feeds.items() if k in accepted}
    with torch.no_grad():
        hidden = module(**feeds, return_dict=True).last_hidden_state
    expected = [hidden.float().as_subclass(torch.Tensor).numpy().copy()]
    if check_abort is not None:
        check_abort()
    run = run_ort(model_path, "run", {k: v.numpy() for k, v in feeds.items()}, work, check_abort)
    found = [np.asarray(run.outputs["last_hidden_state"], dtype=np.float32)]
    err, ref, tol = compare_outputs("onnxruntime", found, expected, atol, rtol)
    report = ParityReport(
        err, ref, tol, len(found), ort_peak_rss_bytes=run.peak_rss_bytes,
        ort_peak_anon_bytes=run.peak_anon_bytes,
    )  # fmt: skip
    if err > tol:
        raise VerificationFailed(
            f"onnxruntime's last_hidden_state differs from PyTorch by {err:.3g} "
            f"(tolerance {tol:.3g})"
        )
    return report


LOGIT_BOUNDS: dict[str, LogitBounds] = {
    "float32": LogitBounds(kl_mean=0.002, kl_p99=0.02, top1=0.97, ppl_ratio=1.02),
    "float16": LogitBounds(kl_mean=0.005, kl_p99=0.05, top1=0.95, ppl_ratio=1.03),
}
"""Per export dtype, as the GGUF check's for f32/f16 (``gguf.llama_check.LOGIT_BOUNDS``)."""


def check_logits(
    model_path: Path,
    dtype: str,
    reference: Any,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """onnxruntime's logits on each chunk of the fixed text against transformers' (the job's
    independent reference, :class:`service.checkpoint.independent.IndependentReference`): KL,
    top-1, perplexity ratio (``service.logits``); VerificationFailed beyond the dtype's bounds."""
    chunks = reference.chunks
    window = scored(int(chunks.shape[1]))
    request: dict[str, np.ndarray] = {
        "chunks": np.asarray(chunks, dtype=np.int64),
        "first": np.asarray(window.start, dtype=np.int64),
        "last": np.asarray(window.stop, dtype=np.int64),
    }
    run = run_ort(model_path, "logits", request, work / "logits", check_abort)
    found = run.outputs["logits"]

    def placed(rows: np.ndarray) -> np.ndarray:
        full = np.zeros((int(chunks.shape[1]), rows.shape[-1]), dtype=np.float32)
        full[window] = rows
        return full

    figures = compare_logits(reference.chunk_logits(), [placed(r) for r in found], chunks)
    bounds = LOGIT_BOUNDS.get(dtype, LOGIT_BOUNDS["float16"])
    failed = bounds.violations(figures)
    if failed:
        raise VerificationFailed(
            f"onnxruntime's run of the ONNX is too far from transformers' run of the source on "
            f"the fixed text: {'; '.join(failed)}"
        )
    return {"reference": reference.summary()["implementation"], **figures.as_dict(),
            "bounds": asdict(bounds)}  # fmt: skip
