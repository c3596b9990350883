"""Is the GGUF what we meant to write? llama.cpp's logits against transformers' run of the
file's *own* weights: an exact check, the same for every type and every model.

The quality report (``llama_check.check_logits``) compares the file with the float source,
so its figures mix two things: what the type's rounding costs (expected, model-dependent: a
near-tie model flips many top-1 tokens for a correct q8_0) and what a fault costs (a skipped
q/k permutation, a wrong norm offset, rows flipped). This check removes the first: the file's
tensors are dequantized with gguf-py and put back in the source's layout
(``artifact_weights``), transformers' forward runs on them, streamed like the job's reference
(``verification.independent``, layer by layer beyond the budget), and llama.cpp's logits on the
fixed text (``llama-perplexity --kl-divergence``) are compared with that.

What is left between the two is arithmetic: llama.cpp converts the activations of each matmul
to its weight type's ``vec_dot_type`` (f16, or q8_0/q8_K blocks) and keeps K and V in f16, where
transformers computes in float32 (``verification.arithmetic``). The same forward computes the
reference's twin with those roundings applied, and their distance, ``c_arith`` (mean KL), is
what this arithmetic costs on this model and this type. llama.cpp's distance ``c`` to the
exact reference is the same roundings (at other points of the graph, with its own
accumulation order), so ``c`` is about ``c_arith``: the tolerance is
``max(KL_FLOOR, TOLERANCE_FACTOR * c_arith)``. KL grows with the square of the logit error, so
the factor 6.25 allows llama.cpp 2.5 times the rounded twin's logit error; ``KL_FLOOR`` is ten
times the resolution of the figure llama-perplexity prints (its mean KL has 6 decimals; the
base file's own log-probability steps of 16/65535 nats cost ~1e-9), for a file whose roundings
cost nothing (f32; f16 on a small model). Measured on the near-tie Llama of the tests (std
0.02, hidden 256, 2 layers): c / c_arith 0.95 (q8_0, c 5e-6), 1.04 (Q4_K_M, 1.3e-5), 1.02
(q4_0, 7e-6); f16 c below the printed resolution, c_arith 1.5e-8. A fault is not arithmetic:
it moves the logits by the size of the weights it touches, orders of magnitude beyond.

A mixture of experts is not judged here (:func:`routed`): its top-k routing is discontinuous,
so a rounding of 1e-3 flips an expert choice wherever two router logits lie that close, and the
positions it flips are not the rounded twin's. The tiny Qwen2-MoE of the families test, a
correct f16, was 35 x this tolerance (mean KL 2.9e-4 against a twin's 8.4e-7) where a dense
model's f16 is under the floor. Its file is judged by the quality report against the float
source, as before this check.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import VerificationFailed

if TYPE_CHECKING:
    from collections.abc import Callable

    from service.checkpoint.base import WeightReader
    from service.verification.independent import IndependentReference

TOLERANCE_FACTOR = 6.25
"""llama.cpp's KL to the exact reference may be this multiple of the rounded twin's (2.5**2:
2.5 times the logit error)."""
KL_FLOOR = 1e-5
"""The tolerance's floor: ten times the resolution of llama-perplexity's printed mean KL."""


ROUTED_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config keys of a mixture of experts' expert count (Qwen2/3-MoE, Mixtral, DeepSeek, ERNIE)."""


def routed(config: dict[str, Any]) -> bool:
    """Whether the model routes tokens to experts (a text config's keys included)."""
    text = config.get("text_config")
    for part in (config, text if isinstance(text, dict) else {}):
        for key in ROUTED_EXPERTS_KEYS:
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return True
    return False


def check_exact(
    gguf_path: Path,
    type_name: str,
    reference: IndependentReference,
    root: Path,
    config: dict[str, Any],
    reader: WeightReader,
    model_class: Any,
    max_memory_bytes: int,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> dict[str, Any]:
    """llama.cpp's logits on the file against transformers' on the file's weights, within
    the arithmetic's tolerance (module docstring); VerificationFailed beyond it. The report
    says both distances, the tolerance and what the weights' map found."""
    import numpy as np

    from service.exporters.gguf.artifact_weights import NotInvertible, write_artifact_weights
    from service.exporters.gguf.llama_check import _kl_run
    from service.verification.independent import independent_reference
    from service.verification.llama_kl import write_llama_base_logits
    from service.verification.logits import FIXED_TEXT, compare_logits
    from service.verification.reference import fixed_input_ids

    assert reference.chunks is not None
    if routed(config):
        return {"judged": False, "reason": "a mixture of experts: top-k routing flips on a "
                "rounding, so no arithmetic bound holds (gguf/exact.py); judged by quality"}
    work.mkdir(parents=True, exist_ok=True)
    weights_dir = work / "artifact-weights"
    try:
        try:
            weights = write_artifact_weights(gguf_path, root, config, reader, weights_dir, bin_dir)
        except NotInvertible as exc:
            return {"judged": False, "reason": f"the converter's transform is not inverted: {exc}"}
        check_abort()
        kinds = _rounding_kinds(weights.ggml_types, config)
        vocab = int(config.get("vocab_size", 0) or 0)
        own = independent_reference(
            weights_dir, model_class, fixed_input_ids(vocab), reference.text or FIXED_TEXT,
            max_memory_bytes,
            work / "artifact-reference", with_outputs=False, twin=kinds,
            chunks=reference.chunks,  # the same text, the same tokenizer files (copied)
        )  # fmt: skip
    finally:
        shutil.rmtree(weights_dir, ignore_errors=True)
    chunks = reference.chunks
    exact, twin = own.chunk_logits(), own.chunk_logits("twin")
    arith = compare_logits(exact, twin, chunks)
    if not np.isfinite(arith.kl_mean):
        # nothing arithmetic to compare with (raw FP8 codes read as weights overflow float32):
        # the quality report, against the float source, judges such a file
        return {"judged": False, "reason": "transformers' run of the file's weights is not finite"}
    base = work / "artifact.logits"
    write_llama_base_logits(base, chunks, int(exact[0].shape[-1]), exact)
    n_ctx = int(chunks.shape[1])
    figures, _, _ = _kl_run(gguf_path, base, n_ctx, arith.positions, work, check_abort, bin_dir, None)
    tolerance = max(KL_FLOOR, TOLERANCE_FACTOR * arith.kl_mean)
    report = {
        "judged": True,
        "reference": f"{own.implementation} of the file's dequantized weights ({own.mode})",
        "kl_mean": figures.kl_mean,
        "kl_p99": figures.kl_p99,
        "top1": figures.top1,
        "arithmetic_kl_mean": arith.kl_mean,
        "arithmetic_top1": arith.top1,
        "tolerance": tolerance,
        "ratio_to_arithmetic": figures.kl_mean / max(arith.kl_mean, 1e-30),
        "transformed_tensors": len(weights.transformed),
        "largest_weight_error": {
            "tensor": weights.largest_error[0], "relative_rms": weights.largest_error[1],
        },
        "from_source": weights.from_source,
    }
    if not figures.kl_mean <= tolerance:  # NaN fails too
        raise VerificationFailed(
            f"{type_name} GGUF is not what was meant to be written: llama.cpp's logits differ from "
            f"transformers' run of the file's own weights by mean KL {figures.kl_mean:.3g} > "
            f"{tolerance:.3g} ({TOLERANCE_FACTOR} x the {arith.kl_mean:.3g} ggml's rounding costs "
            f"on this model); the file's tensors or metadata are not what llama.cpp reads as this "
            f"model (a permutation, a norm offset, a hyperparameter)"
        )
    return report


def _rounding_kinds(ggml_types: dict[str, str], config: dict[str, Any]) -> dict[str, str]:
    """Module path -> ggml's activation rounding for the module's weight type. A tied head is
    multiplied by llama.cpp's token embedding, of that tensor's type."""
    from service.verification.arithmetic import vec_dot_kind

    kinds: dict[str, str] = {}
    for name, type_name in ggml_types.items():
        kind = vec_dot_kind(type_name)
        if kind is not None and name.endswith(".weight") and "embed" not in name:
            kinds[name.removesuffix(".weight")] = kind
    if "lm_head" not in kinds and config.get("tie_word_embeddings"):
        embedding = next((k for k in ggml_types if k.endswith("embed_tokens.weight")), None)
        kind = vec_dot_kind(ggml_types[embedding]) if embedding else None
        if kind is not None:
            kinds["lm_head"] = kind
    return kinds
