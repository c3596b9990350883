"""Numerical parity of an NNEF archive run by tract (PyPI bindings) with its PyTorch model.

tract runs in a child process (:func:`run_tract`): it holds every weight of the archive in RAM,
which must not count against the job process, whose own peak stays that of one weight or two.

Causal LMs are checked the way they are served: tract runs the prompt with an empty KV cache,
then a few greedy decode steps feeding back its own cache; PyTorch computes the logits of the
same token sequence in one cache-less forward (whose weights are streamed from the checkpoint,
so the reference costs one pass over the weights, not one per step). Encoders are run once on a
fixed input. The error is the max absolute difference over every compared output; it must stay
within ``atol + rtol * max|reference|``, else :class:`VerificationFailed`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import VerificationFailed, VerificationTooLarge
from service.exporters.common.child_process import ChildRun, memory_limit, run_npz_child
from service.exporters.nnef import tract_cli
from service.exporters.nnef.plan import tract_mode, tract_peaks
from service.plan import VerificationMode
from service.verification.logits import (
    compare_logits,
    placed_rows,
    runtime_bounds,
    window_request,
)
from service.verification.parity import ParityReport, Tolerance, compare_outputs
from service.verification.reference import GreedyReference


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]
    """Symbolic axes are named (``S`` new tokens, ``P`` past tokens)."""


@dataclass
class IOSpec:
    """What a runtime needs to feed the archive; written next to it as ``io.json``."""

    kind: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    tract_version: str
    compression: str | None = None
    tract_extensions: list[str] = field(
        default_factory=lambda: ["tract_core", "tract_extra", "tract_transformers"]
    )
    notes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IOSpec:
        """Read back what :meth:`to_json` wrote (``io.json``)."""
        fields = dict(data)
        fields["inputs"] = [TensorSpec(**t) for t in data["inputs"]]
        fields["outputs"] = [TensorSpec(**t) for t in data["outputs"]]
        return cls(**fields)


def ensure_tract_fits(
    weight_bytes: int, setting: str | None, block_bytes: int | None = None
) -> VerificationMode:
    """How tract checks the archive within ``MODELPREP_TRACT_MAX_MEMORY`` (``setting``): it
    loads every weight it runs into RAM (no offload, no mmap), so ``whole`` when the archive
    fits, else ``layerwise`` (one block of ``block_bytes`` at a time; None: the model cannot be
    cut, an encoder), else refused up front, naming both needs."""
    limit = memory_limit(setting)
    mode = tract_mode(weight_bytes, block_bytes, limit)
    if mode is not None:
        return mode
    whole, layerwise = tract_peaks(weight_bytes, block_bytes or 0)
    blocks = (
        f" and {layerwise / 2**30:.2f} GiB block by block (largest block "
        f"{(block_bytes or 0) / 2**30:.2f} GiB of weights)"
        if block_bytes is not None
        else " (this model cannot be checked block by block)"
    )
    raise VerificationTooLarge(
        f"tract needs about {whole / 2**30:.2f} GiB of RAM to run this model whole{blocks}, "
        f"more than the {limit / 2**30:.2f} GiB this worker allows (MODELPREP_TRACT_MAX_MEMORY); "
        'export with "verify": false, or on a bigger worker'
    )


def run_tract(
    archive: Path,
    command: str,
    request: dict[str, np.ndarray],
    work: Path,
    check_abort: Callable[[], None] | None = None,
    extra_args: Sequence[str] = (),
) -> ChildRun:
    """Run ``tract_cli.py ARCHIVE COMMAND`` in a child process and read its outputs.

    tract holds the whole archive in RAM: see :mod:`service.exporters.common.child_process`."""

    def argv(request_path: Path, outputs_path: Path) -> list[str]:
        return [
            sys.executable, str(Path(tract_cli.__file__).resolve()), str(archive),
            "--nnef-tract-core", "--nnef-tract-extra", "--nnef-tract-transformers", "-O", command,
            "--input-from-bundle", str(request_path), "--save-outputs-npz", str(outputs_path),
            *extra_args,
        ]  # fmt: skip

    return run_npz_child(argv, request, work, "tract", check_abort, env={"RUST_LOG": "error"})


@dataclass(frozen=True)
class TextCheck:
    """What :func:`check_logits` judges tract's logits on the fixed text with, when
    :func:`verify_causal_lm` runs that check in the same tract child as the decode."""

    dtype: str
    compression: str | None
    reference: Any
    """The job's independent reference (``IndependentReference``, with ``chunks``)."""
    own: np.ndarray | None = None
    """A compressed archive's exact reference: PyTorch's scored-window logits on the archive's
    own weights (:func:`service.exporters.nnef.exact.own_chunk_logits`)."""
    thresholds: Any = None
    """The request's ``QualityThresholds`` for a compressed archive's quality, if it set any."""


def verify_causal_lm(
    archive: Path,
    io: IOSpec,
    expected: GreedyReference,
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
    text: TextCheck | None = None,
) -> ParityReport:
    """Replay ``expected``'s greedy decode in tract, feeding back tract's own KV cache.

    tract is fed PyTorch's tokens (teacher forcing), so one diverging argmax on near-equal logits
    does not derail the comparison; the report says whether tract's argmax agreed at each step.

    With ``text``, the same child also gives the fixed text's logits, judged after the decode
    as :func:`check_logits` judges them (figures in the report's ``extra["logits"]``): tract
    loads the archive once for both checks, and that load (every weight read, unpacked and
    repacked for tract's kernels) is the largest part of either.
    """
    request = decode_request(io, expected)
    if text is not None:
        request.update(window_request(text.reference.chunks))
    run = run_tract(archive, "decode", request, work, check_abort)
    found = list(run.outputs["logits"])
    agreed = [int(np.argmax(f)) == t for f, t in zip(found, expected.tokens, strict=True)]

    def where() -> str:
        return first_diverging_layer(
            archive, io, expected, atol, rtol, work=work / "layers", check_abort=check_abort
        )

    comparison = compare_outputs(found, expected.logits, Tolerance(atol, rtol))
    problem = comparison.unjudgeable("tract")
    if problem is not None:
        raise VerificationFailed(f"{problem}; {where()}")
    if not comparison.passed:
        against = (
            f"PyTorch's run of the archive's own {io.compression} weights (dequantized as stored)"
            if io.compression is not None
            else "PyTorch"
        )
        raise VerificationFailed(
            f"tract logits differ from {against} by {comparison.max_abs_error:.3g} (tolerance "
            f"{comparison.tolerance:.3g}) over {len(found)} decode steps; {where()}"
        )
    extra: dict[str, Any] = {"mode": "whole"}
    if text is not None:
        extra["logits"] = judge_logits(
            run.outputs["chunk_logits"], text, "whole", str(run.outputs["scored_by"]), where
        )
    return ParityReport.of(
        "tract", comparison, len(found), expected.tokens, agreed,
        peak_rss_bytes=run.peak_rss_bytes, extra=extra,
    )  # fmt: skip


def decode_request(io: IOSpec, expected: GreedyReference) -> dict[str, np.ndarray]:
    """The ``decode`` (and ``layerwise``) request: prompt, tokens, empty caches' shapes."""
    return {
        "prompt": np.asarray([expected.prompt], dtype=np.int64),
        "tokens": np.asarray(expected.tokens, dtype=np.int64),
        **_empty_caches(io),
    }


def _empty_caches(io: IOSpec) -> dict[str, np.ndarray]:
    """The archive's KV cache inputs, empty (past axis 0): what tract_cli starts a decode with."""
    return {
        "cache_shapes": np.asarray(
            [[0 if dim == "P" else int(dim) for dim in t.shape] for t in io.inputs[1:]],
            dtype=np.int64,
        ).reshape(len(io.inputs) - 1, -1),
        "cache_dtypes": np.asarray([t.dtype for t in io.inputs[1:]]),
    }


def first_diverging_layer(
    archive: Path,
    io: IOSpec,
    expected: GreedyReference,
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> str:
    """Where tract first leaves PyTorch, as a sentence for the failure message.

    tract replays the decode once more with every layer's output made a graph output
    (``tract_cli decode --layer-outputs``); each is compared, step by step and layer by layer,
    with PyTorch's (recorded by :func:`~service.verification.reference.greedy_reference`)
    within the check's own tolerance, scaled to that layer's magnitude. Only run once a check
    has failed: it unpacks the archive.
    """
    if expected.layers is None:
        return "the layer outputs were not recorded, so the first diverging layer is unknown"
    try:
        run = run_tract(
            archive, "decode", decode_request(io, expected), work, check_abort,
            extra_args=("--layer-outputs", str(work)),
        )  # fmt: skip
    except VerificationFailed as exc:
        return f"tract could not give the layer outputs ({exc})"
    found = run.outputs.get("layers")
    if found is None or found.shape != expected.layers.shape:
        shape = None if found is None else found.shape
        return (
            f"the archive's layer outputs {shape} do not line up with PyTorch's "
            f"{expected.layers.shape}, so the first diverging layer is unknown"
        )
    for step in range(found.shape[0]):
        for index, name in enumerate(expected.layer_names):
            want = expected.layers[step, index].astype(np.float64)
            diff = float(np.abs(found[step, index].astype(np.float64) - want).max(initial=0.0))
            tol = atol + rtol * float(np.abs(want).max(initial=0.0))
            if not diff <= tol:  # NaN diverges too
                when = "on the prompt" if step == 0 else f"at decode step {step}"
                return (
                    f"first diverges at {name} {when} (max abs diff {diff:.3g}, "
                    f"tolerance {tol:.3g})"
                )
    return (
        f"every layer's output agrees ({len(expected.layer_names)} layers): the divergence is "
        "after the last layer (final norm or output head)"
    )


def verify_encoder(
    archive: Path,
    inputs: dict[str, np.ndarray],
    expected: list[np.ndarray],
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> ParityReport:
    """One tract run on ``inputs`` (graph input order) vs PyTorch's ``expected`` outputs."""
    run = run_tract(archive, "run", inputs, work, check_abort)
    found = [run.outputs[f"output_{i}"] for i in range(len(run.outputs))]
    comparison = compare_outputs(found, expected, Tolerance(atol, rtol))
    problem = comparison.unjudgeable("tract")
    if problem is not None:
        raise VerificationFailed(problem)
    if not comparison.passed:
        raise VerificationFailed(
            f"tract outputs differ from PyTorch by {comparison.max_abs_error:.3g} (tolerance "
            f"{comparison.tolerance:.3g})"
        )
    return ParityReport.of(
        "tract", comparison, len(found), peak_rss_bytes=run.peak_rss_bytes,
        extra={"mode": "whole"},
    )


def check_logits(
    archive: Path,
    io: IOSpec,
    dtype: str,
    compression: str | None,
    reference: Any,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
    blocks: Path | None = None,
) -> dict[str, Any]:
    """tract's logits on each chunk of the fixed text against transformers' (the job's
    independent reference, :class:`service.verification.independent.IndependentReference`): KL mean
    and p99, top-1 agreement, perplexity ratio (``service.verification.logits``, the figures ONNX
    and GGUF report); VerificationFailed beyond the dtype's bounds (:data:`RUNTIME_LOGIT_BOUNDS`),
    or a compressed archive's (``q4_0``: :data:`COMPRESSED_LOGIT_BOUNDS`), whose decode is checked
    only against the compressed weights, so this is what judges the compression itself.

    ``blocks``: the archive's blocks cut by the layer-by-layer check
    (:mod:`service.exporters.nnef.layerwise`), run one after the other, each fed the one
    before it, where tract cannot hold the whole archive."""
    chunks = reference.chunks
    request = {**window_request(chunks), **_empty_caches(io)}
    if blocks is None:
        run = run_tract(archive, "logits", request, work, check_abort)
    else:
        run = run_tract(blocks, "layerwise-logits", request, work, check_abort)
    mode = "whole" if blocks is None else "layerwise"
    text = TextCheck(dtype, compression, reference)
    return judge_logits(run.outputs["logits"], text, mode, str(run.outputs["scored_by"]))


def judge_logits(
    found: np.ndarray, text: TextCheck, mode: str, scored_by: str,
    where: Callable[[], str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """:func:`check_logits`' figures and bounds on tract's logits of the scored window
    (``found``, ``(n_chunk, window, vocab)``), wherever tract ran them (``scored_by``, as the
    child says: ``steps`` or ``prefill``). A compressed archive with its exact reference
    (``text.own``) is judged by :func:`service.exporters.nnef.exact.judge_compressed` instead:
    exactly against its own weights, its quality reported (``where``: where tract first
    diverges, for the failure message)."""
    if text.own is not None and text.compression is not None:
        from service.exporters.nnef.exact import judge_compressed

        report = judge_compressed(
            found, text.own, text.reference, text.compression, text.thresholds,
            where or (lambda: "the first diverging layer was not looked for"),
        )  # fmt: skip
        return {**report, "mode": mode, "scored_by": scored_by}
    chunks = text.reference.chunks
    figures = compare_logits(text.reference.chunk_logits(), placed_rows(found, chunks), chunks)
    bounds = runtime_bounds(text.dtype, text.compression)
    report = {"reference": text.reference.summary()["implementation"], **figures.as_dict(),
              "mode": mode, "scored_by": scored_by, "bounds": asdict(bounds)}  # fmt: skip
    failed = bounds.violations(figures)
    if failed:
        raise VerificationFailed(
            f"tract's run of the NNEF archive is too far from transformers' run of the source "
            f"on the fixed text: {'; '.join(failed)}"
        )
    return report
