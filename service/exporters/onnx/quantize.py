"""Weight-only int4/int8 in ONNX: every ``Linear`` as onnxruntime's ``MatMulNBits``, streamed.

The captured graph writes each ``nn.Linear`` as ``MatMul(x, Transpose(W))`` with ``W`` the
torch weight ``[N, K]``. :func:`quantize_matmuls` replaces each such product by
``com.microsoft.MatMulNBits(x, W_Q{bits}, W_scales[, W_zero_points])`` (``K``, ``N``, ``bits``,
``block_size``; no ``accuracy_level``: onnxruntime computes in the activations' float type), the
layout onnxruntime's own quantizer (``MatMulNBitsQuantizer``, QOperator) and onnxruntime-genai's
model builder write. A block of ``block_size`` lies along ``K`` within one row of ``W``, so a
slice of rows quantizes alone: each new initializer is a :class:`NBitsPart` whose ``tofile``
reads ``W`` a slice of rows at a time from the job's offload store (at most
:data:`~service.exporters.onnx.exporter.CHUNK_BYTES` of float32), quantizes the slice with
onnxruntime's kernel (:mod:`service.shims.onnxruntime`, byte for byte what its quantizer writes)
and writes the slice's bytes. The pass that writes the packed blocks spools the slice's scales
and zero points to a file beside it, which the next two initializers copy: one read of ``W``.

What is quantized: every weight read by such a product, the output head included. The input
embedding follows onnxruntime-genai's model builder (``make_embedding_lookup``, 0.18): a head
tied to the embedding at int4 is one quantized weight, which the embedding's ``Gather`` reads
too, as ``com.microsoft.GatherBlockQuantized`` over the head's own packed blocks reshaped to
``[N, K_padded / 2]``, its scales and zero points (then a ``Slice`` when ``K`` is not a whole
number of blocks): :func:`gather_quantized`. The float embedding is then not written at all.
At int8 the builder keeps a float embedding beside the tied head's int8 copy (its
``GatherBlockQuantized`` path is int4 only), and an untied embedding stays float at any width
(the builder quantizes ``Gather`` only when the embedding is shared): so do we. Norms and biases
stay float. Arithmetic: round to nearest (RTN, onnxruntime's default); symmetric blocks have no
zero point input (the kernel's implicit ``2**(bits-1)``, which ``GatherBlockQuantized`` also
takes for ``uint8`` data).

:func:`dequantize` is the inverse the checks use: the float weight ``MatMulNBits`` multiplies
by, and the rows ``GatherBlockQuantized`` returns, from the artifact's own bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from service.exporters.onnx.mapped import weight_products

if TYPE_CHECKING:
    import onnx_ir as ir

MS_DOMAIN = "com.microsoft"
PARTS = ("packed", "scales", "zero_points")


@dataclass(frozen=True)
class NBits:
    """How weights are quantized: bits per element, block size along ``K``, symmetric or not."""

    bits: int
    block_size: int
    symmetric: bool

    def blocks(self, k: int) -> int:
        return (k + self.block_size - 1) // self.block_size

    def shapes(self, n: int, k: int) -> dict[str, tuple[int, ...]]:
        """Each initializer's shape for a weight ``[n, k]`` (onnxruntime's layout)."""
        kpack = 8 // self.bits
        blocks = self.blocks(k)
        return {
            "packed": (n, blocks, (self.block_size + kpack - 1) // kpack),
            "scales": (n, blocks),
            "zero_points": (n, (blocks + kpack - 1) // kpack),
        }

    def quantize_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """(packed, scales, zero_points) of a slice of ``W``'s rows ``[n, K]``."""
        from service.shims.onnxruntime import quantize_columns

        packed, scales, zero_points = quantize_columns(
            np.ascontiguousarray(rows.T), self.bits, self.block_size, self.symmetric
        )
        return {"packed": packed, "scales": scales, "zero_points": zero_points}


def dequantize(
    scheme: NBits,
    k: int,
    packed: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    rows_per_slice: int | None = None,
) -> np.ndarray:
    """The float32 ``[N, K]`` weight ``MatMulNBits`` multiplies by: ``(q - zero) * scale`` per
    block, low nibble first for 4 bits, the implicit zero ``2**(bits-1)`` when symmetric.

    Computed a slice of rows at a time into the result, so that the float32 weight is the only
    whole-tensor term (the plan's ``DEQUANTIZED_ITEMSIZE``), not its intermediates."""
    n = packed.shape[0]
    out = np.empty((n, k), dtype=np.float32)
    step = rows_per_slice or max(1, (16 * 2**20) // max(1, 4 * packed.shape[1] * scheme.block_size))
    for start in range(0, n, step):
        stop = min(n, start + step)
        zp = None if zero_points is None else zero_points[start:stop]
        out[start:stop] = _dequantize_rows(scheme, k, packed[start:stop], scales[start:stop], zp)
    return out


def _dequantize_rows(
    scheme: NBits, k: int, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None
) -> np.ndarray:
    n, blocks, _ = packed.shape
    if scheme.bits == 4:
        q = np.empty((n, blocks, packed.shape[2] * 2), dtype=np.float32)
        q[..., 0::2] = packed & 0x0F
        q[..., 1::2] = packed >> 4
    else:
        q = packed.astype(np.float32)
    if zero_points is None or scheme.symmetric:
        zero = np.full((n, blocks), 2 ** (scheme.bits - 1), dtype=np.float32)
    elif scheme.bits == 4:
        both = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)
        zero = both[:, :blocks].astype(np.float32)
    else:
        zero = zero_points[:, :blocks].astype(np.float32)
    weight = (q - zero[..., None]) * scales.astype(np.float32)[..., None]
    return weight.reshape(n, -1)[:, :k]


class NBitsWeight:
    """One float weight ``[N, K]`` and its three quantized initializers, written in one pass.

    ``rows(start, stop)`` reads a slice of the weight as float32 or float16 (the export's dtype,
    which the scales keep). The first part asked for runs the pass: its own bytes go to the
    data file, the others' to spool files in ``spool``, which their own ``write`` copies and
    deletes."""

    def __init__(
        self, name: str, n: int, k: int, scheme: NBits, rows: Any, itemsize: int, spool: Path
    ) -> None:
        self.name, self.n, self.k, self.scheme = name, n, k, scheme
        self._rows = rows
        self._step = max(1, (64 * 2**20) // max(1, k * max(itemsize, 4)))
        self._spool = spool
        self._spooled: dict[str, Path] = {}

    def parts(self) -> tuple[str, ...]:
        return PARTS[:2] if self.scheme.symmetric else PARTS

    def write(self, part: str, file: BinaryIO) -> None:
        spooled = self._spooled.pop(part, None)
        if spooled is not None:
            with spooled.open("rb") as source:
                while block := source.read(16 * 2**20):
                    file.write(block)
            spooled.unlink()
            return
        self._spool.mkdir(parents=True, exist_ok=True)
        others = {
            p: (self._spool / f"{abs(hash((self.name, p))):x}.{p}").open("wb")
            for p in self.parts() if p != part
        }  # fmt: skip
        try:
            for start in range(0, self.n, self._step):
                quantized = self.scheme.quantize_rows(
                    self._rows(start, min(self.n, start + self._step))
                )
                file.write(quantized[part].data)
                for p, out in others.items():
                    out.write(quantized[p].data)
        finally:
            for p, out in others.items():
                out.close()
                self._spooled[p] = Path(out.name)

    def array(self, part: str) -> np.ndarray:
        """A whole part in memory (onnx-ir's ``numpy()``; the export itself writes with ``tofile``)."""
        import io

        buffer = io.BytesIO()
        self.write(part, buffer)
        dtype = np.uint8 if part != "scales" else self._scales_dtype()
        return np.frombuffer(buffer.getvalue(), dtype=dtype).reshape(
            self.scheme.shapes(self.n, self.k)[part]
        )

    def _scales_dtype(self) -> Any:
        return self._rows(0, 1).dtype

    def discard(self) -> None:
        for path in self._spooled.values():
            path.unlink(missing_ok=True)
        self._spooled.clear()


def _part_tensor_type() -> type[Any]:
    import onnx_ir as ir

    class NBitsPart(ir.LazyTensor):
        """One quantized initializer; ``tofile`` streams it (see :class:`NBitsWeight`)."""

        def __init__(self, weight: NBitsWeight, part: str, **kwargs: Any) -> None:
            super().__init__(lambda: ir.Tensor(weight.array(part)), **kwargs)
            self._weight, self._part = weight, part

        def tofile(self, file: Any) -> None:
            self._weight.write(self._part, file)

    return NBitsPart


def quantize_matmuls(
    graph: ir.Graph, scheme: NBits, rows_of: Any, spool: Path
) -> list[NBitsWeight]:
    """Rewrite every ``MatMul(x, Transpose(W))`` of an initializer ``W`` as ``MatMulNBits``.

    ``rows_of(name)`` returns ``(rows(start, stop), itemsize)`` reading the weight ``name``'s
    rows in the export's dtype. ``W`` leaves the graph unless something else still reads it
    (a tied embedding's ``Gather``). Returns the quantized weights, in graph order."""
    import onnx_ir as ir

    done: list[NBitsWeight] = []
    part_type = _part_tensor_type()
    for transpose, weight, products in weight_products(graph, sole_use=False):
        assert weight is not None and weight.shape is not None and weight.name
        n, k = (int(d) for d in weight.shape.numpy())
        rows, itemsize = rows_of(weight.name)
        quantized = NBitsWeight(weight.name, n, k, scheme, rows, itemsize, spool)
        shapes = scheme.shapes(n, k)
        inputs: list[ir.Value] = []
        for part in quantized.parts():
            dtype = weight.dtype if part == "scales" else ir.DataType.UINT8
            assert dtype is not None
            suffix = {"packed": f"Q{scheme.bits}", "scales": "scales", "zero_points": "zp"}[part]
            value = ir.Value(name=f"{weight.name}_{suffix}", shape=ir.Shape(shapes[part]),
                             type=ir.TensorType(dtype))  # fmt: skip
            value.const_value = part_type(
                quantized, part, dtype=dtype, shape=ir.Shape(shapes[part]), name=value.name
            )
            graph.register_initializer(value)
            inputs.append(value)
        for product in products:
            x = product.inputs[0]
            node = ir.Node(
                MS_DOMAIN, "MatMulNBits", [x, *inputs],
                attributes=[ir.AttrInt64("K", k), ir.AttrInt64("N", n),
                            ir.AttrInt64("bits", scheme.bits),
                            ir.AttrInt64("block_size", scheme.block_size)],
                name=f"{product.name}_Q{scheme.bits}",
            )  # fmt: skip
            result = product.outputs[0]
            node.outputs[0].shape, node.outputs[0].type = result.shape, result.type
            graph.insert_before(product, node)
            result.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
            name = result.name
            result.name = f"{name}_float"
            node.outputs[0].name = name
            graph.remove(product, safe=True)
        graph.remove(transpose, safe=True)
        if not weight.uses():
            graph.initializers.pop(weight.name)
        done.append(quantized)
    if done and MS_DOMAIN not in graph.opset_imports:
        graph.opset_imports[MS_DOMAIN] = 1
    return done


@dataclass(frozen=True)
class QuantizedWeights:
    """What an int4/int8 export quantized: the scheme, the weights each ``MatMulNBits`` reads
    (initializer names of the float weights they replace) and, of those, the ones the embedding
    also reads through ``GatherBlockQuantized`` (a tied head at int4)."""

    scheme: NBits
    matmuls: tuple[str, ...]
    gathered: tuple[str, ...] = ()


GATHERED_BITS = frozenset({4})
"""Widths at which a tied embedding reads the head's blocks: the model builder's (its
``GatherBlockQuantized`` path refuses int8), though onnxruntime's CPU kernel also takes 8."""


def gather_quantized(graph: ir.Graph, scheme: NBits, done: list[NBitsWeight]) -> list[str]:
    """Rewrite each ``Gather(W, ids)`` (axis 0) of a weight ``W`` already quantized for a
    ``MatMulNBits`` (a head tied to the embedding) as ``GatherBlockQuantized`` over ``W``'s
    packed blocks, scales and zero points, as the model builder writes it; ``W`` then leaves
    the graph. Only at :data:`GATHERED_BITS`. Returns the names of the weights so rewritten."""
    import onnx_ir as ir

    if scheme.bits not in GATHERED_BITS:
        return []
    gathered: list[str] = []
    for weight in done:
        value = graph.initializers.get(weight.name)
        if value is None:
            continue
        uses = [use.node for use in value.uses()]
        if not uses or not all(_embedding_gather(node, value) for node in uses):
            continue
        suffixes = {"packed": f"Q{scheme.bits}", "scales": "scales", "zero_points": "zp"}
        parts = [graph.initializers[f"{weight.name}_{suffixes[p]}"] for p in weight.parts()]
        packed_shape = scheme.shapes(weight.n, weight.k)["packed"]
        flat = packed_shape[1] * packed_shape[2]
        padded = scheme.blocks(weight.k) * scheme.block_size
        for gather in uses:
            base = gather.name or f"{weight.name}_gather"
            shape = _int64s(f"{base}_rows_shape", [weight.n, flat])
            reshape = ir.Node("", "Reshape", [parts[0], shape.outputs[0]], name=f"{base}_rows")
            ids = gather.inputs[1]
            gbq = ir.Node(
                MS_DOMAIN, "GatherBlockQuantized", [reshape.outputs[0], ids, *parts[1:]],
                attributes=[ir.AttrInt64("bits", scheme.bits),
                            ir.AttrInt64("block_size", scheme.block_size),
                            ir.AttrInt64("gather_axis", 0), ir.AttrInt64("quantize_axis", 1)],
                name=f"{base}_Q{scheme.bits}",
            )  # fmt: skip
            reshape.outputs[0].name = f"{base}_rows_out"
            new = [shape, reshape, gbq]
            result = gather.outputs[0]
            out = gbq.outputs[0]
            if padded != weight.k:  # the padding of the last block, sliced off as the builder does
                bounds = [
                    _int64s(f"{base}_slice_{label}", [v])
                    for label, v in (("start", 0), ("end", weight.k), ("axis", -1))
                ]
                out.name = f"{base}_padded_out"
                out.type = result.type
                sliced = ir.Node("", "Slice", [out, *(b.outputs[0] for b in bounds)],
                                 name=f"{base}_slice")  # fmt: skip
                new += [*bounds, sliced]
                out = sliced.outputs[0]
            out.shape, out.type = result.shape, result.type
            graph.insert_before(gather, new)
            result.replace_all_uses_with(out, replace_graph_outputs=True)
            name = result.name
            result.name = f"{name}_float"
            out.name = name
            graph.remove(gather, safe=True)
        graph.initializers.pop(weight.name)
        gathered.append(weight.name)
    return gathered


def _int64s(name: str, values: list[int]) -> ir.Node:
    """A ``Constant`` node of int64 ``values`` whose output is named ``{name}_out``."""
    import numpy as np
    import onnx_ir as ir

    value = ir.AttrTensor("value", ir.tensor(np.asarray(values, dtype=np.int64)))
    node = ir.Node("", "Constant", [], attributes=[value], name=name)
    node.outputs[0].name = f"{name}_out"
    return node


def _embedding_gather(node: ir.Node, weight: ir.Value) -> bool:
    """Whether ``node`` is ``Gather(weight, ids)`` along rows: an embedding lookup."""
    axis = node.attributes.get("axis")
    return (
        node.op_type == "Gather" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2
        and node.inputs[0] is weight and (axis is None or axis.as_int() == 0)
    )  # fmt: skip


def quantized_bytes(scheme: NBits, n: int, k: int, itemsize: int) -> int:
    """Bytes a weight ``[n, k]`` takes quantized (its scales in the export's float type)."""
    shapes = scheme.shapes(n, k)
    total = math.prod(shapes["packed"]) + math.prod(shapes["scales"]) * itemsize
    return total + (0 if scheme.symmetric else math.prod(shapes["zero_points"]))


def spool_dir(work: Path) -> Path:
    """Where a quantized weight's scales and zero points wait for their turn to be written."""
    return work / f"nbits-spool-{os.getpid()}"
