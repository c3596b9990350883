"""Numerical parity of an exported ONNX model run by onnxruntime with the PyTorch model.

onnxruntime runs in a child process (:mod:`service.exporters.onnx.ort_cli`, started through
:func:`service.exporters.common.child_process.run_child`): it reads every weight into RAM,
which must not count against the job process. PyTorch's side runs in the job process on the offloaded copy
of the model (each weight re-read from the store while its op runs, a Linear's a block of rows
at a time and an Embedding's the rows of its ids: :func:`~service.exporters.onnx.blocks.weights_in_blocks`),
so the reference costs a pass over the weights, not their sum nor the largest in memory.

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
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import VerificationFailed
from service.exporters.common.child_process import ChildRun, ensure_fits, run_npz_child
from service.exporters.onnx import ort_cli
from service.exporters.onnx.artifact_weights import artifact_weights
from service.exporters.onnx.blocks import weights_in_blocks
from service.verification.logits import compare_logits, placed_rows, runtime_bounds, window_request
from service.verification.parity import (
    Comparison,
    ParityReport,
    Tolerance,
    compare_outputs,
)
from service.verification.reference import GreedyReference, greedy_reference, prompt_ids

if TYPE_CHECKING:
    from torch import nn

    from service.exporters.onnx.quantize import QuantizedWeights

ORT_BASE_BYTES = 256 * 2**20
"""onnxruntime's own footprint (runtime, arena, a short prompt's tensors and KV cache): the
weights are memory-mapped (:mod:`service.exporters.onnx.mapped`), so this does not grow with
the model; 43 MB of anonymous memory was measured on a 2.76 GB Llama."""


def ensure_ort_fits(weight_bytes: int, setting: str | None) -> None:
    """Refuse up front a verification onnxruntime cannot hold. Its weights are memory-mapped
    (``weight_bytes`` of page cache the kernel reclaims as it needs), so what it needs is its
    own footprint, whatever the model's size."""
    ensure_fits("onnxruntime", ORT_BASE_BYTES, setting, "MODELPREP_ORT_MAX_MEMORY")


def _mapped_run(run: ChildRun) -> dict[str, Any]:
    """The manifest's figures of a run with mapped weights: the child's anonymous peak (what
    the runtime itself allocated), the whole model in one session, the weights mapped."""
    return {
        "ort_peak_anon_bytes": int(run.outputs.pop("peak_anon_bytes")),
        "mode": "whole",
        "weights": "mapped",
        **_seconds(run),
    }


def _seconds(run: ChildRun) -> dict[str, float]:
    """onnxruntime's own load and run seconds, as the child measured them."""
    return {
        f"ort_{key}": round(float(run.outputs.pop(key)), 2)
        for key in ("load_seconds", "run_seconds") if key in run.outputs
    }  # fmt: skip


def run_ort(
    model: Path,
    command: str,
    request: dict[str, np.ndarray],
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> ChildRun:
    """Run ``ort_cli.py MODEL COMMAND`` in a child process and read its outputs.

    Its peak RSS is the child's own ``VmHWM``, which it writes among its outputs: wait4's
    ``ru_maxrss`` would include this process's pages (see ort_cli)."""

    def argv(request_path: Path, outputs_path: Path) -> list[str]:
        return [
            sys.executable, "-P", str(Path(ort_cli.__file__).resolve()), str(model), command,
            str(request_path), str(outputs_path),
        ]  # fmt: skip

    return run_npz_child(argv, request, work, "onnxruntime", check_abort)


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
    quantized: QuantizedWeights | None = None,
    genai: bool = False,
) -> ParityReport:
    """PyTorch's greedy decode (``module``, a transformers causal LM) replayed in onnxruntime.

    With ``quantized`` (what the export quantized) PyTorch runs each quantized linear layer, and
    an embedding read through ``GatherBlockQuantized``, on the weight the artifact holds,
    dequantized from its own bytes (:func:`~service.exporters.onnx.artifact_weights.
    artifact_weights`): an exact check of the file, at the float tolerances, that a correct
    int4/int8 file cannot fail for being quantized; each weight's first multiplication also
    holds it to the source's (``largest_weight_error``). With ``genai`` onnxruntime-genai's
    generator then decodes the same prompt greedily from the package directory
    (:func:`check_genai`)."""
    config: Any = module.config
    prompt = prompt_ids(prompt_tokens, int(config.vocab_size))
    if quantized is None:
        with weights_in_blocks(module):
            expected = greedy_reference(module, prompt, decode_steps)
    else:
        with artifact_weights(module, model_path, quantized) as errors, weights_in_blocks(module):
            expected = greedy_reference(module, prompt, decode_steps)
        if len(errors.errors) < len(quantized.matmuls):
            raise VerificationFailed(
                f"{len(quantized.matmuls)} weights were quantized, {len(errors.errors)} "
                "compared with the source's: a quantized layer never ran"
            )
    if check_abort is not None:
        check_abort()
    request = {
        "prompt": np.asarray([expected.prompt], dtype=np.int64),
        "tokens": np.asarray(expected.tokens, dtype=np.int64),
    }
    run = run_ort(model_path, "decode", request, work, check_abort)
    found = list(run.outputs["logits"])
    comparison = _judged(compare_outputs(found, expected.logits, Tolerance(atol, rtol)))
    err, tol = comparison.max_abs_error, comparison.tolerance
    agreed = [int(np.argmax(f)) == t for f, t in zip(found, expected.tokens, strict=True)]
    if not comparison.passed:
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
    extra = _mapped_run(run)
    if quantized is not None:
        extra["reference_weights"] = "dequantized from the artifact"
        extra["largest_weight_error"] = errors.largest()
    if genai:
        extra["genai"] = check_genai(model_path.parent, expected, err, work, check_abort)
    return ParityReport.of(
        "ort", comparison, len(found), expected.tokens, agreed, peak_rss_bytes=run.peak_rss_bytes,
        extra=extra,
    )  # fmt: skip


def check_genai(
    package: Path,
    expected: GreedyReference,
    err: float,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """onnxruntime-genai's greedy generator on the package directory against PyTorch's tokens.

    The generator runs free (its own tokens fed back), so the first token it differs on ends
    the comparison: a divergence where PyTorch's own top two logits lie within twice the
    error measured in onnxruntime is a tie and passes, any other fails. A stop on an end of
    sequence token PyTorch also chose ends it too."""
    request = {
        "prompt": np.asarray([expected.prompt], dtype=np.int64),
        "steps": np.asarray(len(expected.tokens), dtype=np.int64),
    }
    run = run_ort(package / "model.onnx", "generate", request, work / "genai", check_abort)
    tokens = [int(t) for t in run.outputs["tokens"]]
    agreed = 0
    for step, (got, want) in enumerate(zip(tokens, expected.tokens, strict=False)):
        if got != want:
            top2 = np.sort(expected.logits[step].astype(np.float64))[-2:]
            margin = float(top2[1] - top2[0])
            if margin > 2 * err:
                raise VerificationFailed(
                    f"onnxruntime-genai's greedy token differs from PyTorch's at step {step} "
                    f"({got} vs {want}; PyTorch's margin {margin:.3g}, error {err:.3g})"
                )
            break
        agreed += 1
    return {"tokens": tokens, "agreed_steps": agreed, "steps": len(expected.tokens),
            "peak_rss_bytes": run.peak_rss_bytes, **_seconds(run)}  # fmt: skip


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
    with torch.no_grad(), weights_in_blocks(module):
        hidden = module(**feeds, return_dict=True).last_hidden_state
    expected = [hidden.float().as_subclass(torch.Tensor).numpy().copy()]
    if check_abort is not None:
        check_abort()
    run = run_ort(model_path, "run", {k: v.numpy() for k, v in feeds.items()}, work, check_abort)
    found = [np.asarray(run.outputs["last_hidden_state"], dtype=np.float32)]
    comparison = _judged(compare_outputs(found, expected, Tolerance(atol, rtol)))
    if not comparison.passed:
        raise VerificationFailed(
            f"onnxruntime's last_hidden_state differs from PyTorch by "
            f"{comparison.max_abs_error:.3g} (tolerance {comparison.tolerance:.3g})"
        )
    return ParityReport.of(
        "ort", comparison, len(found), peak_rss_bytes=run.peak_rss_bytes, extra=_mapped_run(run)
    )


def _judged(comparison: Comparison) -> Comparison:
    """:class:`VerificationFailed` for outputs no tolerance can judge (shapes, non-finite)."""
    problem = comparison.unjudgeable("onnxruntime")
    if problem is not None:
        raise VerificationFailed(problem)
    return comparison


def check_logits(
    model_path: Path,
    dtype: str,
    reference: Any,
    work: Path,
    check_abort: Callable[[], None] | None = None,
    *,
    judged: bool = True,
) -> dict[str, Any]:
    """onnxruntime's logits on each chunk of the fixed text against transformers' (the job's
    independent reference, :class:`service.verification.independent.IndependentReference`): KL,
    top-1, perplexity ratio (``service.verification.logits``); VerificationFailed beyond the dtype's
    bounds when ``judged``. Quantized weights are reported, not judged: their distance from the
    float source is the quantization's quality, not the file's correctness (which
    :func:`verify_causal_lm` checks exactly)."""
    chunks = reference.chunks
    request = window_request(chunks)
    run = run_ort(model_path, "logits", request, work / "logits", check_abort)
    found = run.outputs["logits"]
    figures = compare_logits(reference.chunk_logits(), placed_rows(found, chunks), chunks)
    bounds = runtime_bounds(dtype)
    if not judged:
        return {"reference": reference.summary()["implementation"], **figures.as_dict(),
                "judged": False, **_seconds(run)}  # fmt: skip
    failed = bounds.violations(figures)
    if failed:
        raise VerificationFailed(
            f"onnxruntime's run of the ONNX is too far from transformers' run of the source on "
            f"the fixed text: {'; '.join(failed)}"
        )
    return {"reference": reference.summary()["implementation"], **figures.as_dict(),
            "bounds": asdict(bounds), **_seconds(run)}  # fmt: skip
