"""Block-scaled FP8 checkpoints read as the float model they encode, one tensor (or rows) at a time.

Layout (DeepSeek-V3/R1, Qwen3-*-FP8; ``quant_method: "fp8"``): a weight ``W`` of shape
``(..., rows, cols)`` is stored as ``float8_e4m3fn`` codes ``q`` beside ``W_scale_inv`` of shape
``(..., ceil(rows / bm), ceil(cols / bn))``, ``[bm, bn]`` being ``weight_block_size``; element
``(r, c)`` is ``q[r, c] * scale_inv[r // bm, c // bn]``. Edge blocks may be partial (DeepSeek's
``kv_a_proj_with_mqa`` has 576 rows in 128-row blocks); transformers' ``Fp8Dequantize`` requires
whole blocks, and on those the arithmetic here is its own: both factors in float32, the product
rounded once to the model's dtype. ``F8_E8M0`` scales (``scale_fmt: ue8m0``) are powers of two and
convert to float32 exactly.

:class:`Fp8DequantReader` wraps the checkpoint's reader: the scale tensors disappear from
:meth:`tensor_infos`, each FP8 weight is listed in the model's dtype, and reads dequantize rows
as they go, so memory stays what a float checkpoint's read costs (a row range of codes and its
scale rows, never the whole tensor twice). Nothing is referenced in place (:meth:`region` is
None for a dequantized weight): its bytes on disk are not the weight's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from service.checkpoint.base import FileRegion, ReadsInto, TensorInfo, WeightReader


def dequantize_rows(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    first_row: int,
    rows_per_matrix: int,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``[first_row, first_row + len(codes))`` of a weight flattened to ``(-1, cols)``.

    ``codes`` is those rows' FP8 codes ``(n, cols)``; ``scale_inv`` the whole scale grid
    flattened to ``(-1, ceil(cols / bn))``; ``rows_per_matrix`` the weight's ``shape[-2]`` (a
    3-D expert stack is one matrix after another, each with its own grid rows)."""
    bm, bn = block
    n, cols = codes.shape
    grid_rows = -(-rows_per_matrix // bm)
    index = torch.arange(first_row, first_row + n)
    scale_rows = (index // rows_per_matrix) * grid_rows + (index % rows_per_matrix) // bm
    scales = scale_inv.to(torch.float32).index_select(0, scale_rows)  # (n, grid cols)
    out = codes.to(torch.float32)
    full, rem = divmod(cols, bn)
    if full:
        out[:, : full * bn].view(n, full, bn).mul_(scales[:, :full, None])
    if rem:
        out[:, full * bn :].mul_(scales[:, full:])
    return out.to(dtype)


class Fp8DequantReader:
    """A :class:`WeightReader` over ``inner`` that serves each FP8 weight dequantized to
    ``dtype`` and hides the scale tensors (``scales``: weight name -> scale name)."""

    def __init__(
        self,
        inner: WeightReader,
        scales: dict[str, str],
        block: tuple[int, int],
        dtype: torch.dtype,
    ) -> None:
        self.inner, self.scales, self.block, self.dtype = inner, dict(scales), block, dtype
        hidden = set(self.scales.values())
        self._infos = [
            replace(i, dtype=dtype) if i.name in self.scales else i
            for i in inner.tensor_infos()
            if i.name not in hidden
        ]
        self._by_name = {i.name: i for i in self._infos}
        self._scale_cache: tuple[str, torch.Tensor] | None = None

    # --- WeightReader ------------------------------------------------------------------------

    def tensor_infos(self) -> list[TensorInfo]:
        return list(self._infos)

    def aliases(self) -> dict[str, str]:
        return self.inner.aliases()

    def add_alias(self, alias: str, canonical: str) -> None:
        self.inner.add_alias(alias, canonical)

    def read(self, name: str) -> torch.Tensor:
        weight = self._fp8(name)
        if weight is None:
            return self.inner.read(name)
        info = self._by_name[weight]
        codes = self.inner.read(weight).reshape(-1, info.shape[-1])
        out = dequantize_rows(codes, self._scale(weight), 0, info.shape[-2], self.block, self.dtype)
        return out.reshape(info.shape)

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        weight = self._fp8(name)
        if weight is None:
            yield from self.inner.iter_chunks(name, max_bytes)
            return
        info = self._by_name[weight]
        cols = info.shape[-1]
        rows = info.numel // cols if cols else 0
        per = max(1, max_bytes // max(1, cols * self.dtype.itemsize))
        for start in range(0, rows, per):
            yield self._rows(weight, start, min(per, rows - start)).reshape(-1)

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the flattened (dequantized) tensor."""
        weight = self._fp8(name)
        if weight is None:
            if isinstance(self.inner, ReadsInto):
                self.inner.read_into(name, start, out)
            else:
                out.copy_(self.inner.read(name).reshape(-1)[start : start + out.numel()])
            return
        info = self._by_name[weight]
        if out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"read_into {name!r} needs a contiguous {self.dtype} buffer")
        n = out.numel()
        if start < 0 or start + n > info.numel:
            raise IndexError(f"read_into {name!r}: range past the end of the tensor")
        if n == 0:
            return
        cols = info.shape[-1]
        first, last = start // cols, (start + n - 1) // cols
        rows = self._rows(weight, first, last - first + 1).reshape(-1)
        offset = start - first * cols
        out.reshape(-1).copy_(rows[offset : offset + n])

    def region(self, name: str) -> FileRegion | None:
        return None if self._fp8(name) is not None else self.inner.region(name)

    def close(self) -> None:
        self._scale_cache = None
        self.inner.close()

    # --- internals ---------------------------------------------------------------------------

    def _fp8(self, name: str) -> str | None:
        """The stored FP8 weight ``name`` reads (through a tie), or None for any other tensor."""
        canonical = self.inner.aliases().get(name, name)
        return canonical if canonical in self.scales else None

    def _scale(self, weight: str) -> torch.Tensor:
        """The weight's scale grid flattened to ``(-1, grid cols)``; the last one is kept (a
        grid is 1/16384 of its weight at 128x128: row-range reads ask for it again and again)."""
        if self._scale_cache is None or self._scale_cache[0] != weight:
            grid = self.inner.read(self.scales[weight])
            self._scale_cache = (weight, grid.reshape(-1, grid.shape[-1]))
        return self._scale_cache[1]

    def _rows(self, weight: str, first: int, count: int) -> torch.Tensor:
        """Rows ``[first, first + count)`` of the weight flattened to ``(-1, cols)``, dequantized."""
        info = self._by_name[weight]
        cols = info.shape[-1]
        codes = torch.empty(count * cols, dtype=torch.float8_e4m3fn)
        if isinstance(self.inner, ReadsInto):
            self.inner.read_into(weight, first * cols, codes)
        else:
            codes.copy_(self.inner.read(weight).reshape(-1)[first * cols : (first + count) * cols])
        return dequantize_rows(
            codes.reshape(count, cols), self._scale(weight), first, info.shape[-2], self.block,
            self.dtype,
        )  # fmt: skip
