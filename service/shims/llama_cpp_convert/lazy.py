"""Reading upstream's lazy tensors: which a planned tensor is (a checkpoint tensor's first rows,
one row, a stack of them), so that it is read as such instead of evaluated whole, and evaluating
the others once (:class:`OneShot`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch


class ConverterReader(Protocol):
    """What the shim needs of a checkpoint reader (service.checkpoint.base.WeightReader)."""

    def tensor_infos(self) -> list[Any]: ...

    def aliases(self) -> dict[str, str]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]: ...


class OneShot:
    """A lazy upstream tensor evaluated at most once, then released.

    Upstream's lazy graph caches every intermediate result in its nodes once evaluated, so holding
    it after use would keep the tensor alive; the caller plans again to evaluate it a second time.
    """

    def __init__(self, tensor: Any, lazy_type: Any) -> None:
        self._tensor: Any = tensor
        self._lazy_type = lazy_type

    def __call__(self) -> np.ndarray:
        import numpy as np
        import torch

        tensor, self._tensor = self._tensor, None
        if tensor is None:
            raise RuntimeError("an upstream tensor is evaluated once per plan; plan again")
        if isinstance(tensor, self._lazy_type):
            tensor = self._lazy_type.to_eager(tensor)
        out = np.ascontiguousarray(tensor.to(torch.float32).numpy())
        del tensor
        return out


def leading_rows(tensor: Any, data: Any) -> int | None:
    """``n`` when ``tensor`` is upstream's lazy ``data[:n]``, else None.

    Why: Gemma's class trims the embedding's padded vocabulary rows this way; evaluated through
    the lazy graph that is the whole embedding in float32 at once (262144 x 640 on the 270M,
    262144 x 5376 on the 27B). The first ``n`` rows of a checkpoint tensor are read as such, in
    row blocks, like any copied tensor. Relies on gguf-py's lazy ``__getitem__`` recording
    ``_func`` (``torch.Tensor.__getitem__``) and ``_args`` (``(data, key)``): a test names it.
    """
    import torch

    if getattr(tensor, "_func", None) is not torch.Tensor.__getitem__:
        return None
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    if len(args) != 2 or args[0] is not data or not isinstance(args[1], slice):
        return None
    key: slice = args[1]
    if key.start not in (None, 0) or key.step not in (None, 1) or not isinstance(key.stop, int):
        return None
    return key.stop if key.stop >= 0 else None


def picked_row(tensor: Any, data: Any) -> int | None:
    """``i`` when ``tensor`` is upstream's lazy ``data[i]`` (one row), else None.

    Why: LLaVA's Pixtral class copies the ``[IMG_BREAK]`` row of the text embedding into the
    projector as ``data[token_id]``; evaluated through the lazy graph that is the whole
    embedding in float32 (131072 x 5120 x 4 = 2.7 GB on Pixtral 12B) for one row. The row is
    read alone instead (:func:`row_reader`). Relies on the same recording as
    :func:`leading_rows`, with an int key: a test names it."""
    import torch

    if getattr(tensor, "_func", None) is not torch.Tensor.__getitem__:
        return None
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    if len(args) != 2 or args[0] is not data or type(args[1]) is not int:
        return None
    return args[1] if args[1] >= 0 else None


def row_reader(
    reader: ConverterReader, name: str, index: int, width: int, dtype: torch.dtype
) -> Callable[[], np.ndarray]:
    """Float32 values of row ``index`` (``width`` elements) of the stored tensor ``name`` (of
    ``dtype``), read without the rest of the tensor: ``read_into`` where the reader has it,
    else its chunks up to the row (bounded by the chunk size, never the whole tensor)."""

    def compute() -> np.ndarray:
        import numpy as np
        import torch

        start = index * width
        read_into = getattr(reader, "read_into", None)
        if read_into is not None:
            row = torch.empty(width, dtype=dtype)
            read_into(name, start, row)
        else:
            pieces, seen = [], 0
            for chunk in reader.iter_chunks(name, 16 << 20):
                flat = chunk.reshape(-1)
                if seen + flat.numel() > start:
                    pieces.append(flat[max(0, start - seen) : start + width - seen].clone())
                seen += flat.numel()
                if seen >= start + width:
                    break
            row = torch.cat(pieces)
        return np.ascontiguousarray(row.to(torch.float32).numpy())

    return compute


def stacked_rows(tensor: Any, leaves: dict[int, str]) -> tuple[str, ...] | None:
    """The checkpoint tensors, in order, when ``tensor`` is upstream's lazy
    ``torch.stack([...], dim=0)`` of tensors it was given unchanged (``leaves``: id of each lazy
    tensor handed to upstream -> its checkpoint name), else None.

    Why: a MoE layer's converter class (Mixtral's and Qwen2-MoE's ``modify_tensors``) stacks
    every expert of the layer into one 3-D tensor; evaluated through the lazy graph that is all
    of the layer's experts in float32 at once (8 x 14336 x 4096 x 4 = 1.9 GB per projection on
    Mixtral 8x7B). Stacked on the first dimension, the result's rows are the experts' rows one
    expert after the other: each is read as a copied tensor, in row blocks. Relies on gguf-py's
    lazy ``__torch_function__`` recording ``_func`` (``torch.stack``), ``_args``
    (``(tensors,)``) and ``_kwargs`` (``{"dim": 0}``): a test names it.
    """
    import torch

    if getattr(tensor, "_func", None) is not torch.stack:
        return None
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    kwargs: dict[str, Any] = dict(getattr(tensor, "_kwargs", {}) or {})
    if not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if dim != 0 or len(args) > 2 or set(kwargs) - {"dim"}:
        return None
    names = [_leaf_name(part, leaves) for part in args[0]]
    if any(name is None for name in names):
        return None
    return tuple(str(name) for name in names)


def _leaf_name(tensor: Any, leaves: dict[int, str]) -> str | None:
    """The checkpoint name of a lazy tensor handed to upstream, seen through upstream's
    widening to float32 (``prepare_tensors`` does ``data_torch.to(torch.float32)`` to every
    tensor that is neither float16 nor float32: a bfloat16 expert arrives as that, values
    unchanged). gguf-py records a method call as a lambda over ``(tensor, *args)``, so the cast
    is recognised by what it is: one float32 argument, the leaf's shape, a float32 result
    from a narrower dtype (a ``view`` of another width would change the shape)."""
    import torch

    name = leaves.get(id(tensor))
    if name is not None:
        return name
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    if len(args) != 2 or args[1] is not torch.float32 or getattr(tensor, "_kwargs", None):
        return None
    leaf, meta = args[0], getattr(tensor, "_meta", None)
    name = leaves.get(id(leaf))
    leaf_meta = getattr(leaf, "_meta", None)
    if name is None or meta is None or leaf_meta is None:
        return None
    widened = meta.dtype == torch.float32 and leaf_meta.dtype.itemsize < 4
    return name if widened and tuple(meta.shape) == tuple(leaf_meta.shape) else None
