"""Numerical parity of an NNEF archive run by tract (PyPI bindings) with the PyTorch model it came from.

Causal LMs are checked the way they are served: tract runs the prompt with an empty KV cache,
then a few greedy decode steps feeding back its own cache; PyTorch computes the logits of the
same token sequence in one cache-less forward (whose weights are streamed from the checkpoint,
so the reference costs one pass over the weights, not one per step). Encoders are run once on a
fixed input. The error is the max absolute difference over every compared output; it must stay
within ``atol + rtol * max|reference|``, else :class:`VerificationFailed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import VerificationFailed
from service.exporters.tract_cli import load_runnable


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

    def summary(self) -> dict[str, Any]:
        return asdict(self)


_TRACT_DTYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64"}


def _fact_dtype(fact: Any, fallback: str) -> str:
    """The dtype tract expects for an input (its fact prints as ``1,2,P,16,F16``)."""
    return _TRACT_DTYPES.get(str(fact).rsplit(",", 1)[-1].strip(), fallback)


def _check(
    found: list[np.ndarray], expected: list[np.ndarray], atol: float, rtol: float
) -> tuple[float, float, float]:
    err = 0.0
    ref = 0.0
    for f, e in zip(found, expected, strict=True):
        if f.shape != e.shape:
            raise VerificationFailed(f"tract output shape {f.shape} != PyTorch {e.shape}")
        if not np.all(np.isfinite(f)):
            raise VerificationFailed("tract produced non-finite values")
        diff = np.abs(f.astype(np.float64) - e.astype(np.float64))
        err = max(err, float(diff.max(initial=0.0)))
        ref = max(ref, float(np.abs(e).max(initial=0.0)))
    return err, ref, atol + rtol * ref


@dataclass(frozen=True)
class GreedyReference:
    """PyTorch's greedy decode: the token fed at each step and the logits it produced."""

    prompt: list[int]
    tokens: list[int]
    """Greedy tokens, one per step (the last one is produced, not fed)."""
    logits: list[np.ndarray]
    """Logits of the last position at each step: the prompt, then each fed token."""


def greedy_reference(model: Any, prompt: Sequence[int], decode_steps: int) -> GreedyReference:
    """Greedy decode with the KV cache in PyTorch (``model`` is a transformers causal LM)."""
    import torch

    tokens: list[int] = []
    logits: list[np.ndarray] = []
    ids = torch.tensor([list(prompt)], dtype=torch.int64)
    past = None
    with torch.no_grad():
        for _ in range(decode_steps + 1):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            last = out.logits[0, -1].float().as_subclass(torch.Tensor)
            logits.append(last.numpy().copy())
            tokens.append(int(torch.argmax(last)))
            past = out.past_key_values
            ids = torch.tensor([[tokens[-1]]], dtype=torch.int64)
    return GreedyReference([int(t) for t in prompt], tokens, logits)


def verify_causal_lm(
    archive: Path, io: IOSpec, expected: GreedyReference, atol: float, rtol: float
) -> ParityReport:
    """Replay ``expected``'s greedy decode in tract, feeding back tract's own KV cache.

    tract is fed PyTorch's tokens (teacher forcing), so one diverging argmax on near-equal logits
    does not derail the comparison; the report says whether tract's argmax agreed at each step.
    """
    runnable = load_runnable(archive)
    caches = []
    for i, spec in enumerate(io.inputs[1:], start=1):
        shape = [0 if dim == "P" else int(dim) for dim in spec.shape]
        caches.append(np.zeros(shape, dtype=_fact_dtype(runnable.input_fact(i), spec.dtype)))
    step_ids = np.asarray([expected.prompt], dtype=np.int64)
    found: list[np.ndarray] = []
    agreed: list[bool] = []
    for token in expected.tokens:
        outputs = [t.to_numpy() for t in runnable.run([step_ids, *caches])]
        logits = outputs[0].reshape(-1, outputs[0].shape[-1])[-1]
        found.append(logits)
        agreed.append(int(np.argmax(logits)) == token)
        caches = outputs[1:]
        step_ids = np.asarray([[token]], dtype=np.int64)
    del runnable, caches
    err, ref, tol = _check(found, expected.logits, atol, rtol)
    report = ParityReport(err, ref, tol, len(found), expected.tokens, agreed)
    if err > tol:
        raise VerificationFailed(
            f"tract logits differ from PyTorch by {err:.3g} (tolerance {tol:.3g}) over "
            f"{len(found)} decode steps"
        )
    return report


def verify_encoder(
    archive: Path,
    inputs: list[np.ndarray],
    expected: list[np.ndarray],
    atol: float,
    rtol: float,
) -> ParityReport:
    """One tract run on ``inputs`` (graph input order) vs PyTorch's ``expected`` outputs."""
    runnable = load_runnable(archive)
    found = [t.to_numpy() for t in runnable.run([np.ascontiguousarray(a) for a in inputs])]
    del runnable
    if len(found) != len(expected):
        raise VerificationFailed(f"tract gave {len(found)} outputs, PyTorch {len(expected)}")
    err, ref, tol = _check(found, expected, atol, rtol)
    report = ParityReport(err, ref, tol, len(found))
    if err > tol:
        raise VerificationFailed(
            f"tract outputs differ from PyTorch by {err:.3g} (tolerance {tol:.3g})"
        )
    return report
