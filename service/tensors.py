"""How the service names a dtype and sees a tensor's bytes, written once.

``dtype_name`` is the one spelling (``float16``, not ``torch.float16``) that manifests, offload
indexes, job details and tolerance tables share, so a lookup by name never misses for want of
a prefix. ``tensor_bytes`` is the zero-copy view every writer hands to ``os.write``.

torch is imported only inside ``tensor_bytes``: exporters' spec modules import this in the API
process, which never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"float16"`` for ``torch.float16``; a name (``"q8_0"``) is returned as it is."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order, without a copy when it is contiguous.

    Reinterpreted as uint8 before numpy sees it, because numpy has no bfloat16 or float8;
    flattened first, so that ``view`` is legal whatever the shape."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")
