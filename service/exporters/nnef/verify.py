"""Numerical parity of an NNEF archive run by tract (PyPI bindings) with the PyTorch model it came from.

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

from service.errors import VerificationFailed
from service.exporters.common.child_process import compare_outputs, ensure_fits, run_child
from service.exporters.nnef import tract_cli


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


@dataclass(frozen=True)
class ParityReport:
    max_abs_err: float
    ref_max_abs: float
    tolerance: float
    compared: int
    """Output vectors compared (decode steps + 1 for an LLM, outputs for an encoder)."""
    tokens: list[int] = field(default_factory=list)
    """Greedy tokens of the reference decode (causal LMs)."""
    argmax_agreed: list[bool] = field(default_factory=list)
    """Whether tract's argmax was the reference token at each step (causal LMs)."""
    tract_peak_rss_bytes: int = 0
    """Peak RSS of the tract child process (it holds the whole archive in RAM)."""

    def summary(self) -> dict[str, Any]:
        return asdict(self)


TRACT_BASE_BYTES = 256 * 2**20
"""tract's own footprint beyond the weights (runtime, activations of a short prompt)."""


@dataclass(frozen=True)
class GreedyReference:
    """PyTorch's greedy decode: the token fed at each step and the logits it produced."""

    prompt: list[int]
    tokens: list[int]
    """Greedy tokens, one per step (the last one is produced, not fed)."""
    logits: list[np.ndarray]
    """Logits of the last position at each step: the prompt, then each fed token."""
    layer_names: list[str] = field(default_factory=list)
    """The decoder layers' module names (``model.layers.0``...), when recorded."""
    layers: np.ndarray | None = None
    """Last position of each layer's output at each step, ``[steps, layers, hidden]``."""


def decoder_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of each layer of the model's layer stack: its longest ``ModuleList``."""
    from torch import nn

    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        return []
    name, stack = max(stacks, key=lambda item: len(item[1]))
    return [(f"{name}.{i}", layer) for i, layer in enumerate(stack)]


def greedy_reference(
    model: Any, prompt: Sequence[int], decode_steps: int, *, record_layers: bool = False
) -> GreedyReference:
    """Greedy decode with the KV cache in PyTorch (``model`` is a transformers causal LM).

    With ``record_layers`` each layer's output (last position) is kept too, through forward
    hooks: a few KiB per layer and step, what a failed check compares to say where it starts."""
    import torch

    tokens: list[int] = []
    logits: list[np.ndarray] = []
    layers = decoder_layers(model) if record_layers else []
    step_layers: list[np.ndarray | None] = [None] * len(layers)
    recorded: list[np.ndarray] = []

    def keep(index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            last = hidden.reshape(-1, hidden.shape[-1])[-1].float().as_subclass(torch.Tensor)
            step_layers[index] = last.numpy().copy()

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, (_, layer) in enumerate(layers)]
    ids = torch.tensor([list(prompt)], dtype=torch.int64)
    past = None
    try:
        with torch.no_grad():
            for _ in range(decode_steps + 1):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                last = out.logits[0, -1].float().as_subclass(torch.Tensor)
                logits.append(last.numpy().copy())
                tokens.append(int(torch.argmax(last)))
                past = out.past_key_values
                ids = torch.tensor([[tokens[-1]]], dtype=torch.int64)
                if layers and all(x is not None for x in step_layers):
                    recorded.append(np.stack([x for x in step_layers if x is not None]))
    finally:
        for handle in handles:
            handle.remove()
    complete = bool(layers) and len(recorded) == decode_steps + 1
    return GreedyReference(
        [int(t) for t in prompt], tokens, logits,
        layer_names=[n for n, _ in layers] if complete else [],
        layers=np.stack(recorded) if complete else None,
    )  # fmt: skip


def ensure_tract_fits(weight_bytes: int, setting: str | None) -> None:
    """Refuse up front a verification tract cannot hold: it loads every weight of the archive
    into RAM (no offload, no mmap)."""
    need = int(weight_bytes * 1.1) + TRACT_BASE_BYTES
    ensure_fits("tract", need, setting, "MODELPREP_TRACT_MAX_MEMORY")


@dataclass(frozen=True)
class TractRun:
    outputs: dict[str, np.ndarray]
    peak_rss_bytes: int


def run_tract(
    archive: Path,
    command: str,
    request: dict[str, np.ndarray],
    work: Path,
    check_abort: Callable[[], None] | None = None,
    extra_args: Sequence[str] = (),
) -> TractRun:
    """Run ``tract_cli.py ARCHIVE COMMAND`` in a child process and read its outputs.

    tract holds the whole archive in RAM: see :mod:`service.exporters.common.child_process`."""
    work.mkdir(parents=True, exist_ok=True)
    request_path, outputs_path = work / "request.npz", work / "outputs.npz"
    np.savez(request_path, **request)  # type: ignore[arg-type]
    argv = [
        sys.executable, "-P", str(Path(tract_cli.__file__).resolve()), str(archive),
        "--nnef-tract-core", "--nnef-tract-extra", "--nnef-tract-transformers", "-O", command,
        "--input-from-bundle", str(request_path), "--save-outputs-npz", str(outputs_path),
        *extra_args,
    ]  # fmt: skip
    peak = run_child(argv, work, "tract", check_abort, env={"RUST_LOG": "error"})
    with np.load(outputs_path) as bundle:
        outputs = {k: bundle[k] for k in bundle.files}
    return TractRun(outputs, peak)


def verify_causal_lm(
    archive: Path,
    io: IOSpec,
    expected: GreedyReference,
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> ParityReport:
    """Replay ``expected``'s greedy decode in tract, feeding back tract's own KV cache.

    tract is fed PyTorch's tokens (teacher forcing), so one diverging argmax on near-equal logits
    does not derail the comparison; the report says whether tract's argmax agreed at each step.
    """
    request = _decode_request(io, expected)
    run = run_tract(archive, "decode", request, work, check_abort)
    found = list(run.outputs["logits"])
    agreed = [int(np.argmax(f)) == t for f, t in zip(found, expected.tokens, strict=True)]

    def where() -> str:
        return first_diverging_layer(
            archive, io, expected, atol, rtol, work=work / "layers", check_abort=check_abort
        )

    try:
        err, ref, tol = compare_outputs("tract", found, expected.logits, atol, rtol)
    except VerificationFailed as exc:
        raise VerificationFailed(f"{exc}; {where()}") from exc
    report = ParityReport(
        err, ref, tol, len(found), expected.tokens, agreed, tract_peak_rss_bytes=run.peak_rss_bytes
    )
    if err > tol:
        raise VerificationFailed(
            f"tract logits differ from PyTorch by {err:.3g} (tolerance {tol:.3g}) over "
            f"{len(found)} decode steps; {where()}"
        )
    return report


def _decode_request(io: IOSpec, expected: GreedyReference) -> dict[str, np.ndarray]:
    return {
        "prompt": np.asarray([expected.prompt], dtype=np.int64),
        "tokens": np.asarray(expected.tokens, dtype=np.int64),
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
    with PyTorch's (recorded by :func:`greedy_reference`) within the check's own tolerance,
    scaled to that layer's magnitude. Only run once a check has failed: it unpacks the archive.
    """
    if expected.layers is None:
        return "the layer outputs were not recorded, so the first diverging layer is unknown"
    try:
        run = run_tract(
            archive, "decode", _decode_request(io, expected), work, check_abort,
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
    if len(found) != len(expected):
        raise VerificationFailed(f"tract gave {len(found)} outputs, PyTorch {len(expected)}")
    err, ref, tol = compare_outputs("tract", found, expected, atol, rtol)
    report = ParityReport(err, ref, tol, len(found), tract_peak_rss_bytes=run.peak_rss_bytes)
    if err > tol:
        raise VerificationFailed(
            f"tract outputs differ from PyTorch by {err:.3g} (tolerance {tol:.3g})"
        )
    return report
