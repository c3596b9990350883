"""A tensor whose data lives in an offload store and is read back on each use.

In the spirit of torch-to-nnef's ``OffloadedTensor``, but with no pickle on disk and no private
file per tensor, and named apart from it so that each name means one thing here (the NNEF
export meets both): a :class:`StoreTensor` is a ``torch.Tensor`` wrapper subclass with the
logical shape, dtype and device ("cpu") and no storage. Module code uses it like any weight;
``__torch_dispatch__`` loads the bytes from the store for the one aten op that needs them and
drops them afterwards, so nothing stays resident. Every load is counted on the tensor
(``reloads``, ``bytes_read``) and on the store.

A quantized weight composes: its store entry holds GGML-packed bytes, the tensor keeps its float
dtype, and each access dequantizes (``bytes_read`` counts packed bytes).
"""

from __future__ import annotations

from typing import Any, Self

import torch
from torch.utils._pytree import tree_map

from service.offload.store import OffloadStore

_aten = torch.ops.aten
_SHARE_OPS = {_aten.detach.default, _aten.alias.default}


class StoreTensor(torch.Tensor):
    """Shape, dtype and a store key; the data is read from disk whenever an op needs it."""

    store: OffloadStore
    key: str
    reloads: int
    bytes_read: int

    @staticmethod
    def __new__(
        cls, store: OffloadStore, key: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Self:
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=torch.device("cpu"), requires_grad=False
        )
        self.store = store
        self.key = key
        self.reloads = 0
        self.bytes_read = 0
        return self

    def __init__(
        self, store: OffloadStore, key: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        super().__init__()

    @classmethod
    def from_store(cls, store: OffloadStore, key: str, dtype: torch.dtype) -> StoreTensor:
        """A tensor over the store entry ``key``, presented (and decoded) as ``dtype``."""
        return cls(store, key, store.entry(key).shape, dtype)

    def materialize(self) -> torch.Tensor:
        """A fresh plain CPU tensor with this tensor's values; the caller owns (and frees) it."""
        before = self.store.bytes_read
        tensor = self.store.load(self.key, dtype=self.dtype)
        self.reloads += 1
        self.bytes_read += self.store.bytes_read - before
        return tensor

    def share(self) -> StoreTensor:
        """Another handle on the same stored data (what ``detach`` returns)."""
        return StoreTensor(self.store, self.key, tuple(self.shape), self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"StoreTensor(key={self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"encoding={self.store.entry(self.key).encoding})"
        )

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError("a StoreTensor is a handle on a job's disk; pass the store path")

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _SHARE_OPS and isinstance(args[0], StoreTensor):
            return args[0].share()
        if func._schema.is_mutable and any(
            isinstance(arg, StoreTensor) and info.alias_info and info.alias_info.is_write
            for arg, info in zip(args, func._schema.arguments, strict=False)
        ):
            # the write would land in a temporary copy and vanish: refuse it loudly
            raise TypeError(f"{func} would modify an offloaded (read-only) tensor")

        def unwrap(value: Any) -> Any:
            return value.materialize() if isinstance(value, StoreTensor) else value

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
