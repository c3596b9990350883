"""What every checkpoint reader offers: tensor metadata up front, data one tensor (or chunk) at a time.

Readers never hold more than the tensor being read; callers that need bounded memory for a huge
tensor use :meth:`WeightReader.iter_chunks`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    # Annotations only: the API process imports these types (through the exporters' specs)
    # and has no use for torch.
    import torch


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    """The file holding the data (a shard)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FileRegion:
    """Where a tensor's raw little-endian bytes lie in a file (safetensors: referenced in place)."""

    path: Path
    offset: int
    length: int


class WeightReader(Protocol):
    def tensor_infos(self) -> list[TensorInfo]:
        """Every stored tensor, in storage order (reading in this order is sequential I/O)."""
        ...

    def aliases(self) -> dict[str, str]:
        """Names whose data is another stored tensor's (tied weights): alias -> canonical name."""
        ...

    def add_alias(self, alias: str, canonical: str) -> None:
        """Serve the stored tensor ``canonical`` under the absent name ``alias`` as well: a tie
        the config implies but the file does not hold (see ``service.checkpoint.ties``)."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """A fresh CPU tensor owned by the caller; no file pages stay resident because of it."""
        ...

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        """The tensor's elements, flattened, in pieces of at most ``max_bytes``."""
        ...

    def region(self, name: str) -> FileRegion | None:
        """The tensor's bytes in a file when they can be used in place, else None."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ReadsInto(Protocol):
    """Optional reader capability: fill a caller's buffer instead of allocating.

    Streaming writers reuse a few buffers this way; a fresh 64 MiB tensor per chunk costs
    more in page faults than the read itself (measured: 3x the CPU of a reused buffer).
    """

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of the flattened tensor into ``out``
        (contiguous, same dtype as the tensor)."""
        ...


@runtime_checkable
class ReadsInParts(Protocol):
    """Optional reader capability: a tensor served from several stored ones (a MoE layer's
    expert stack, ``checkpoint.experts``) whose bytes still lie in files, piece after piece, so
    the offload store can reference them in place instead of copying them."""

    def regions(self, name: str) -> list[FileRegion] | None:
        """The tensor's bytes as consecutive file regions, in order, or None when some piece
        cannot be used in place."""
        ...


@dataclass
class Checkpoint:
    """A local checkpoint: weights plus the files that travel with them."""

    root: Path
    format: Literal["safetensors", "pickle"]
    weight_files: list[Path]
    reader: WeightReader
    config: dict[str, Any] | None = None
    aux_files: list[Path] = field(default_factory=list)
    """config.json, generation_config.json, tokenizer files: carried over to exports."""
    rewritten: list[Path] = field(default_factory=list)
    """Entries of ``aux_files`` the job rewrote into its own work directory (config.json without
    a handled ``quantization_config``): trusted although outside ``root``."""
    quantization: dict[str, Any] | None = None
    """How the readers handled config.json's ``quantization_config`` (dequantized, ignored as
    contradicted by the tensors), for the manifest; None for a plain float checkpoint. ``config``
    no longer holds the ``quantization_config`` once handled: what the readers serve is float."""
    adapter_root: Path | None = None
    """The PEFT LoRA adapter the reader merges into the weights (``checkpoint.lora``), if any:
    the independent reference merges it too."""
    unmerged_adapter: Path | None = None
    """The PEFT LoRA adapter the job keeps apart (``"merge": false``): the reader serves the
    base's weights, and exports that take an adapter unmerged write it beside them."""

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
