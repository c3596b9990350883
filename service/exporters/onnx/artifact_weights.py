"""An int4/int8 ONNX's own weights for PyTorch's side of the exact check, and each one's
distance from the source's.

The exact check (:func:`service.exporters.onnx.verify.verify_causal_lm`) runs PyTorch on the
weights ``MatMulNBits`` and ``GatherBlockQuantized`` read from the artifact, dequantized from
its own bytes a block of rows at a time (:func:`artifact_weights`). That holds onnxruntime to
the file, not the file to the source: a quantizer handed a weight's rows upside down writes a
file consistent with itself, which onnxruntime and PyTorch then agree on, and whose quality
figures on a low-margin model move by less than int4's rounding. So the first time the check
multiplies by a quantized weight, each dequantized block is also compared with the source's
rows (read from the offload store in blocks, as the quantizer read them): a relative RMS error
beyond :data:`~service.verification.weight_error.WEIGHT_ERROR_BOUND` fails the check naming the
weight, and the largest error is reported (:class:`WeightErrors`). Memory: the source's block
beside the dequantized one (the plan's ``DEQUANTIZED_ITEMSIZE`` term), never a whole weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import VerificationFailed
from service.exporters.onnx import blocks
from service.exporters.onnx.plan import DEQUANTIZED_ITEMSIZE
from service.verification.weight_error import WEIGHT_ERROR_BOUND, WeightError

if TYPE_CHECKING:
    from torch import nn

    from service.exporters.onnx.quantize import NBits, QuantizedWeights


@dataclass
class WeightErrors:
    """Each quantized weight's relative RMS error against the source's, measured the first time
    the check multiplies by it; :meth:`record` fails a weight beyond the bound."""

    bits: int
    errors: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, error: float) -> None:
        """Keep ``name``'s error; :class:`VerificationFailed` beyond the bound (NaN too)."""
        if not error <= WEIGHT_ERROR_BOUND:
            raise VerificationFailed(
                f"{name}: the ONNX's int{self.bits} values are not the source's (relative RMS "
                f"error {error:.3g} > {WEIGHT_ERROR_BOUND}, where int{self.bits} rounding costs "
                "a fraction of that): the file holds other rows, scales or zero points of this "
                "weight"
            )
        self.errors[name] = error

    def largest(self) -> dict[str, Any]:
        """The manifest's figure: the weight farthest from the source's, and how many were
        compared."""
        name, error = max(self.errors.items(), key=lambda item: item[1], default=("", 0.0))
        return {"tensor": name, "relative_rms": error, "weights": len(self.errors)}


@contextlib.contextmanager
def artifact_weights(
    module: nn.Module, model_path: Path, quantized: QuantizedWeights
) -> Iterator[WeightErrors]:
    """While inside, each linear layer of ``module`` whose weight was quantized
    (``quantized.matmuls``) multiplies by the weight ``MatMulNBits`` reads from the artifact: its
    packed blocks, scales and zero points dequantized (:func:`service.exporters.onnx.quantize.
    dequantize`) from the mapped data file a block of rows at a time (:data:`blocks.
    WRITE_BLOCK_BYTES` of float32), when the layer runs: never a whole weight in float32. Each
    embedding whose weight ``GatherBlockQuantized`` reads (``quantized.gathered``) looks up the
    rows of its ids dequantized from the same blocks. Yields the weights' errors against the
    source's, filled as the layers first run."""
    from torch import nn

    stored = external_initializers(model_path)
    by_tensor: dict[int, set[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), set()).add(name)
    scheme = quantized.scheme
    wanted, gathered = set(quantized.matmuls), set(quantized.gathered)
    errors = WeightErrors(scheme.bits)

    def parts(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        suffix = {"packed": f"Q{scheme.bits}", "scales": "scales", "zero_points": "zp"}
        found = {p: stored(f"{name}_{s}") for p, s in suffix.items()}
        packed, scales = found["packed"], found["scales"]
        if packed is None or scales is None:
            raise VerificationFailed(f"the artifact lacks {name}'s quantized blocks")
        return packed, scales, found["zero_points"]

    patched: list[nn.Module] = []
    embeddings = 0
    try:
        for layer in module.modules():
            names = by_tensor.get(id(getattr(layer, "weight", None)), set())
            if isinstance(layer, nn.Linear) and names & wanted:
                name = min(names & wanted)
                layer.forward = _dequantized_linear(layer, scheme, parts(name), name, errors)  # type: ignore[method-assign]
                patched.append(layer)
            elif isinstance(layer, nn.Embedding) and names & gathered:
                layer.forward = _dequantized_rows(layer, scheme, parts(min(names & gathered)))  # type: ignore[method-assign]
                patched.append(layer)
                embeddings += 1
        if len(wanted) > len(patched) - embeddings or len(gathered) > embeddings:
            raise VerificationFailed(
                f"{len(wanted)} weights were quantized and {len(gathered)} gathered quantized, "
                f"{len(patched) - embeddings} linear layers and {embeddings} embeddings read them"
            )
        yield errors
    finally:
        for layer in patched:
            del layer.forward


def _source_rows(weight: Any) -> Iterator[np.ndarray]:
    """The source weight's values in C order, as the quantizer read them (the export's dtype,
    from the offload store), in blocks of at most :data:`blocks.WRITE_BLOCK_BYTES`; a weight
    the store does not hold is read whole (the reference's own weights always are held)."""
    import torch

    target = weight.elem.dtype if hasattr(weight, "elem") else weight.dtype
    pieces = blocks.weight_blocks(weight, target, blocks.WRITE_BLOCK_BYTES)
    if pieces is None:
        pieces = iter([_plain(weight)])
    for piece in pieces:
        yield (piece.float() if piece.dtype == torch.bfloat16 else piece).numpy()


def _dequantized_linear(
    layer: nn.Linear, scheme: NBits, parts: Any, name: str, errors: WeightErrors
) -> Any:
    """``layer``'s forward on its weight dequantized from the artifact, a block of rows at a
    time; its first run also measures the blocks against the source's rows (``errors``)."""
    import torch

    from service.exporters.onnx.quantize import dequantize

    packed, scales, zero_points = parts

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = x.as_subclass(torch.Tensor)
        bias = None if layer.bias is None else _plain(layer.bias)
        rows, k = layer.out_features, layer.in_features
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype)
        step = max(1, blocks.WRITE_BLOCK_BYTES // (k * DEQUANTIZED_ITEMSIZE))
        error = None if name in errors.errors else WeightError(_source_rows(layer.weight))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            zp = None if zero_points is None else zero_points[start:stop]
            weight = dequantize(scheme, k, packed[start:stop], scales[start:stop], zp)
            if error is not None:
                error.add(weight)
            w = torch.from_numpy(weight).to(x.dtype)
            out[..., start:stop] = torch.nn.functional.linear(
                x, w, None if bias is None else bias[start:stop]
            )
        if error is not None:
            errors.record(name, error.value)
        return out

    return forward


def _dequantized_rows(layer: nn.Embedding, scheme: NBits, parts: Any) -> Any:
    """``layer``'s own forward (a subclass's scaling included) on the rows of its ids alone,
    dequantized from the artifact: the weight is lent, for the call, a table of those rows and
    the ids are renumbered into it."""
    import torch
    from torch import nn

    from service.exporters.onnx.quantize import dequantize

    packed, scales, zero_points = parts
    original = type(layer).forward
    k = layer.embedding_dim

    def forward(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.as_subclass(torch.Tensor)
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = unique.numpy()
        zp = None if zero_points is None else np.asarray(zero_points[rows])
        table = dequantize(scheme, k, np.asarray(packed[rows]), np.asarray(scales[rows]), zp)
        weight, padding = layer._parameters["weight"], layer.padding_idx
        dtype = weight.dtype if weight is not None else torch.float32
        layer._parameters["weight"] = nn.Parameter(
            torch.from_numpy(table).to(dtype), requires_grad=False
        )
        layer.padding_idx = None  # a row number of the whole table; it only shapes gradients
        try:
            out: torch.Tensor = original(layer, inverse.reshape(ids.shape))
        finally:
            layer._parameters["weight"], layer.padding_idx = weight, padding
        return out

    return forward


def _plain(tensor: Any) -> Any:
    """A weight of the offloaded model as a plain tensor: an offloaded one re-read from the
    store (``as_subclass`` alone would keep no data: PyTorch's dispatch then fails)."""
    import torch

    from service.shims.torch_to_nnef import CheckpointTensor

    if isinstance(tensor, CheckpointTensor):
        return tensor.reload().as_subclass(torch.Tensor)
    return tensor.as_subclass(torch.Tensor)


def external_initializers(model_path: Path) -> Callable[[str], np.ndarray | None]:
    """A reader of the graph's initializers by name, memory-mapped from the data file (read
    only, left mapped: a caller reads the rows it needs; small ones, which ``ir.save`` keeps
    inside the graph, from the graph); None for a name the graph lacks."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path), load_external_data=False)
    where: dict[str, tuple[Path, int, Any, tuple[int, ...]]] = {}
    inline: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        if "location" not in info:
            inline[init.name] = numpy_helper.to_array(init)
            continue
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        where[init.name] = (
            model_path.parent / info["location"], int(info.get("offset", 0)), dtype,
            tuple(int(d) for d in init.dims),
        )  # fmt: skip

    def read(name: str) -> np.ndarray | None:
        if name not in where:
            return inline.get(name)
        path, offset, dtype, shape = where[name]
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)

    return read
