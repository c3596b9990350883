"""torch-to-nnef's internals this service patches or extends, in one place.

Assumptions (each checked by tests/unit/shims/test_torch_to_nnef.py, which names the one that
broke; torch-to-nnef capped in pyproject.toml at the series they were checked on):

* ``OffloadedTensor.reload()`` goes through the private ``_reload_unmanaged(device)``, which
  :class:`CheckpointTensor` overrides to read the checkpoint's bytes instead of a ``.pt`` file;
  ``update_values(values, strict_shape, strict_dtype)`` rewrites the payload.
* The NNEF writer (``torch_to_nnef.nnef_io.writer``) writes an offloaded variable through its
  module attribute ``write_offloaded_tensor(tensor, filename, quantized)`` and archives through
  ``tgz_compress(dir, file, compression_level)``; ``write_nnef_tensor`` and
  ``maybe_torch_to_np`` write one array (:func:`checkpoint_tensors_writable` swaps both).
  ``write_nnef_tensor`` is ``nnef.write_tensor``: a 128-byte header (magic, version, data
  length, rank, the shape padded to ``nnef.binary.MaxTensorRank`` dimensions, bits and item
  type from ``nnef.binary._numpy_dtype_split``, 19 reserved words) then the array's bytes in C
  order, little-endian; :func:`write_dat_in_blocks` writes that header itself and the bytes a
  block of rows at a time, so no whole tensor (the 4 GiB float32 embedding of a bfloat16 70B)
  is ever in RAM.
* ``QScalePerGroupF16._dequantize`` is a ``torch.compile`` wrapper of
  ``_dequantize_original`` (:func:`eager_q4_dequantize` calls the latter).
* torch-to-nnef pickles only classes of ``tensor.quant.base`` and ``tensor.quant.qtract`` in
  its offloaded payloads and loads them with ``torch.load`` looked up on the module at call
  time (:func:`weights_only_unpickling` swaps it for a weights-only one).
* It stages files with ``tempfile.mkdtemp``/``TemporaryDirectory`` (:func:`job_tempdir`).
* Its LLM exporter's ``ctx_dtype_dyn_cache`` replaces ``transformers.cache_utils.DynamicLayer.update``
  (transformers >= 4.56) and on exit restores only ``DynamicCache.update``: the patched layer
  update stays for the rest of the process and breaks a later ``torch.export`` of a decoder with
  a dynamic cache (an ONNX export after an NNEF one in the same job). :func:`cache_update_restored`
  puts both back.
* That replacement (``torch_to_nnef_llm.models.base._force_dyn_layer_update_ge4_56``, looked up
  as a module global when the context is entered) stores the first keys without setting the
  layer's ``is_initialized``, so ``get_seq_length()`` stays 0: an eager decode with the cache
  then restarts positions at 0 every step (SmolLM2's PyTorch reference drifted by 12.9 after the
  prompt). :func:`cache_update_restored` also swaps in :func:`_initialized_layer_update`, which
  keeps the concat-without-empty-tensor that tract needs and the layer's bookkeeping.
* Its LLM exporter's text handler (``torch_to_nnef_llm.models.handlers.default.
  DefaultArchitectureHandler.build_forward_inputs(self, *, inputs, wrapper)``, ``inputs`` =
  ``(input_ids, *past)``) hands the model one additive causal mask, ``[1, 1, S, P+S]``, under
  ``model_inputs["attention_mask"]``; transformers takes a 4-D mask as it is for every layer,
  so a sliding-window layer (Mistral, Qwen2 with ``use_sliding_window``, Gemma 3) attended past
  its window and the archive diverged from transformers once a context outgrew the window.
  :func:`sliding_window_masks` gives such a model its window (a ``{"full_attention",
  "sliding_attention"}`` mapping where the model has ``layer_types``, as the library's own
  Gemma 3 VLM handler does).
* Its LLM exporter sizes each layer's KV cache inputs with ``torch_to_nnef_llm.config.
  HFConfigHelper.get_num_kv_heads(self, layer_idx)``, which reads a ``num_kv_heads`` config
  key as OpenELM's per-layer list and otherwise ``num_key_value_heads``: Falcon's
  ``num_kv_heads`` is one int (a ``TypeError``), and its new decoder architecture caches every
  head anyway; GPT-NeoX has no ``num_key_value_heads`` (an ``AttributeError``).
  :func:`cache_heads_from_config` answers for those two (:func:`cached_kv_heads`).
* Its MoE extractor (``torch_to_nnef.op.custom_extractors.moe``) cuts each MoE block's expert
  stacks into graph variables through the module global ``_maybe_quantize_expert_weight(node,
  name, data, ...)``, which returns ``data`` itself unless it quantizes; the graph then holds
  every layer's stacks in RAM until the archive is written (a 195 MiB Qwen3-MoE: 487 MiB above
  the job's base, a dense model of the same size 296 MiB). :func:`moe_experts_offloaded` writes
  each stack to the job's offload directory as an ``OffloadedTensor`` (what the library does for
  quantized stacks under ``T2N_OFFLOAD_QUANTIZED_EXPERTS``), which the writer writes from its
  file: 293 MiB.

* ``OffloadedTensor.__torch_function__`` (a classmethod) reloads a weight whole for every op
  on it; a real forward's ``F.embedding`` and ``F.linear`` reach :class:`CheckpointTensor`'s
  override with the weight second, which reads a weight larger than its block a block of rows
  at a time (the 4 GiB float32 vocabulary of a 70B, embedded or multiplied). In the trace the
  weights are wrapped (``OpaqueTensorRef``): ``OpaqueTensor.to_trace_tensor(device)`` goes
  through ``_to_trace_tensor(device)``, which materializes an ``embedding``'s weight
  (``device`` ``"cpu"``), and the wrapper asks the module global
  ``opaque.trace_tensor_device_for_func(func)`` whether a call may use a ``"meta"``
  placeholder, None for ``is_floating_point`` and ``numel`` (a whole reload each):
  :meth:`CheckpointTensor._to_trace_tensor` and :func:`metadata_from_shells` answer both without
  the weight's values.

The patches are context managers: a job process enters them around an export and leaves them
as they were.

Why one module of over 450 lines: it is one library's internals, each patch beside the
assumption it makes, and its test names them all; the weight-reading ones (:class:`CheckpointTensor`,
the writer's blocks, the trace's placeholders) depend on each other's attributes. This module imports torch and torch-to-nnef at import time: import it inside
functions.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch_to_nnef.tensor.offload import OffloadedTensor

from service.errors import UnsafePickle


class TensorSource(Protocol):
    """Where a :class:`CheckpointTensor` re-reads its bytes: a checkpoint reader or the store."""

    def read(self, name: str) -> torch.Tensor: ...


ReloadHook = Callable[[int], None]
"""Called with the byte size of every weight read: progress, metrics, cancellation."""

WRITE_BLOCK_BYTES = 64 << 20
"""The most stored bytes of one weight the NNEF writer reads at a time (its cast beside it: up
to twice that for bfloat16 written as float32), whatever the tensor's size; the plan's term
(``service.exporters.nnef.plan``)."""


class CheckpointTensor(OffloadedTensor):  # type: ignore[misc]
    """An ``OffloadedTensor`` whose payload is the checkpoint's own bytes.

    ``source`` is the stored tensor name; once torch-to-nnef rewrites the values
    (``update_values``) it becomes None and the parent's ``.pt`` file in ``offload_dir`` is used.
    """

    elem: torch.Tensor
    reader: TensorSource
    source: str | None
    hook: ReloadHook | None
    block_bytes: int | None = None
    """The most stored bytes read at a time when the weight is written, and above which a
    forward or the trace reads it in blocks (:attr:`in_blocks`); the NNEF export sets it
    (:func:`read_in_blocks`). None (the ONNX export's weights): whole in a forward, as
    torch-to-nnef does; the NNEF writer then writes in :data:`WRITE_BLOCK_BYTES` blocks."""
    looked_up_by_inputs: bool = False
    """The model's input embedding, which the graph indexes with its ``input_ids`` (an input,
    never a constant): the trace may run it on zeros (:meth:`_to_trace_tensor`)."""

    @classmethod
    def create(
        cls,
        reader: TensorSource,
        source: str,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        offload_dir: Path,
        hook: ReloadHook | None = None,
    ) -> CheckpointTensor:
        shell = torch.empty(shape, dtype=dtype, device="meta")
        tensor: CheckpointTensor = cls(
            shell, "cpu", offload_dir=offload_dir, name=name, offloaded_tensor_type=torch.Tensor
        )
        tensor.reader, tensor.source, tensor.hook = reader, source, hook
        return tensor

    def _reload_unmanaged(self, device: Any = None) -> torch.Tensor:
        if self.source is None:
            return super()._reload_unmanaged(device=device)  # type: ignore[no-any-return]
        value = self.reader.read(self.source)
        if self.hook is not None:
            self.hook(value.nbytes)
        shell: torch.Tensor = self.elem
        if value.dtype != shell.dtype:
            value = value.to(shell.dtype)
        target = self.target_device if device is None else torch.device(device)
        return value.to(target)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """Casts stay lazy (applied at each reload) instead of rewriting the payload."""
        if self.source is None:
            return super().to(*args, **kwargs)
        dtype = kwargs.get("dtype")
        device = kwargs.get("device")
        for arg in args:
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif arg is not None:
                device = arg
        shell: torch.Tensor = self.elem
        if dtype is not None and dtype != shell.dtype:
            self.elem = shell.to(dtype)
        if device is not None:
            self.target_device = torch.device(device)
        return self

    def numel(self) -> int:
        """From the meta shell, not the payload: ``OffloadedTensor.__torch_function__`` answers
        every method call but attribute access by reading the whole weight back, and
        torch-to-nnef's LLM exporter counts elements that way (its dtype vote,
        ``n_parameters``), as does the job's tract budget: one full read of the model each
        (4.2 s of a 90 s verified export of 1.1 GB). A payload torch-to-nnef rewrote to
        another tensor type (q4_0) still asks it."""
        if self.offloaded_tensor_type is torch.Tensor:
            return int(self.elem.numel())
        return int(super().numel())

    def element_size(self) -> int:
        """The shell's dtype's size (the dtype every reload is cast to): see :meth:`numel`."""
        if self.offloaded_tensor_type is torch.Tensor:
            return int(self.elem.element_size())
        return int(super().element_size())

    def update_values(
        self, values: torch.Tensor, strict_shape: bool = True, strict_dtype: bool = True
    ) -> None:
        if self.source is not None:
            self.source = None
            strict_dtype = False  # there is no previous .pt payload to compare with
        super().update_values(values, strict_shape=strict_shape, strict_dtype=strict_dtype)

    @property
    def in_blocks(self) -> bool:
        """Whether this weight is read in blocks when a forward or the trace uses it: the
        checkpoint's own bytes, larger than :attr:`block_bytes`."""
        shell: torch.Tensor = self.elem
        return (
            self.source is not None
            and self.block_bytes is not None
            and shell.numel() * shell.element_size() > self.block_bytes
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """A real forward's ``embedding`` and ``linear`` of a weight :attr:`in_blocks` read it a
        block of rows at a time (:func:`_embedding_in_blocks`, :func:`_linear_in_blocks`)
        instead of torch-to-nnef's whole reload; the trace (``torch.jit.is_tracing``) and every
        other call are the parent's."""
        kwargs = kwargs or {}
        weight = args[1] if len(args) > 1 else None
        tracing = torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
        if isinstance(weight, CheckpointTensor) and weight.in_blocks and not tracing:
            max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
            if func is torch.nn.functional.embedding and max_norm is None:
                return _embedding_in_blocks(args[0], weight)
            if func is torch.nn.functional.linear and not kwargs.keys() - {"bias"}:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return _linear_in_blocks(args[0], weight, bias)
        return super().__torch_function__(func, types, args, kwargs)

    def _to_trace_tensor(self, device: Any) -> torch.Tensor:
        """The trace asks real values of an ``embedding``'s weight (torch-to-nnef materializes
        it, lest a constant index bake uninitialized memory): for the input embedding
        (:attr:`looked_up_by_inputs`, indexed by the graph's ``input_ids``) :attr:`in_blocks`,
        zeros of its shape on untouched anonymous pages (:func:`_zero_pages`), no weight
        memory. The traced graph is the same; its variable is written from the weight itself.
        Other embeddings (positions, token types: constant indices) keep the library's path."""
        shell: torch.Tensor = self.elem
        if device != "meta" and self.looked_up_by_inputs and self.in_blocks:
            return _zero_pages(tuple(shell.shape), shell.dtype)
        return super()._to_trace_tensor(device)  # type: ignore[no-any-return]

    def iter_rows(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first row, rows)`` of the value in the shell's dtype, read :attr:`block_bytes`
        stored bytes at a time (:meth:`iter_blocks`): a row is never split."""
        shell: torch.Tensor = self.elem
        row_shape = tuple(shell.shape[1:])
        per_row = max(1, math.prod(row_shape))
        pending: list[torch.Tensor] = []
        have = start = 0
        for chunk in self.iter_blocks(self.block_bytes or WRITE_BLOCK_BYTES):
            pending.append(chunk)
            have += chunk.numel()
            del chunk
            full = have // per_row
            if not full:
                continue
            flat = torch.cat(pending) if len(pending) > 1 else pending[0]
            rest = flat[full * per_row :].clone()  # less than a row
            rows = flat[: full * per_row].reshape(full, *row_shape)
            del flat
            pending.clear()
            yield start, rows
            del rows
            start += full
            pending, have = ([rest] if rest.numel() else []), rest.numel()

    def iter_blocks(self, max_bytes: int = WRITE_BLOCK_BYTES) -> Iterator[torch.Tensor]:
        """The value's elements, flattened in C order and cast to the shell's dtype, in pieces
        read ``max_bytes`` stored bytes at a time (the source's ``iter_chunks``); one whole
        reload for a source that cannot read in pieces or a payload torch-to-nnef rewrote."""
        chunks = getattr(self.reader, "iter_chunks", None)
        if self.source is None or chunks is None:
            yield self.reload().reshape(-1)
            return
        shell: torch.Tensor = self.elem
        for chunk in chunks(self.source, max_bytes):
            if self.hook is not None:
                self.hook(chunk.nbytes)
            block = chunk.to(shell.dtype)
            del chunk  # the stored piece is gone before the caller gets its cast
            yield block
            del block  # and the cast before the next piece is read



def _offload_state_globals() -> list[Any]:
    """The classes torch-to-nnef pickles in its own offloaded q4_0 payloads (and nothing else)."""
    from torch_to_nnef.tensor.quant import base as qbase
    from torch_to_nnef.tensor.quant import qtract

    found: list[Any] = []
    for mod in (qbase, qtract):
        for value in vars(mod).values():
            if isinstance(value, type) and value.__module__ == mod.__name__:
                found.append(value)
    return found


@contextlib.contextmanager
def weights_only_unpickling() -> Iterator[None]:
    """Within the block every ``torch.load`` is ``weights_only=True``, whatever the caller asks.

    torch-to-nnef falls back to ``weights_only=False`` for a ``.bin`` that needs it and reloads
    its own offloaded q4_0 payloads that way; both now either load under the allow-list of
    torch-to-nnef's quantization classes or raise :class:`UnsafePickle`. The job runs in its
    own process, so swapping the module attribute affects nobody else.
    """
    real_load = torch.load
    allowed = _offload_state_globals()

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            raise UnsafePickle(
                f"refused to unpickle {Path(str(f)).name}: it holds objects other than tensors"
            ) from exc

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


def _tgz_compress(dir_path: str, file_path: str, compression_level: int = 0) -> None:
    """nnef_tools' ``tgz_compress`` with 8 MiB copies instead of tarfile's 16 KiB ones."""
    with tarfile.open(file_path, "w:gz", compresslevel=compression_level) as tar:
        tar.copybufsize = 8 << 20  # type: ignore[attr-defined]  # real attribute, not in typeshed
        for name in sorted(os.listdir(dir_path)):
            tar.add(os.path.join(dir_path, name), name)


@contextlib.contextmanager
def checkpoint_tensors_writable() -> Iterator[None]:
    """Teach torch-to-nnef's NNEF writer to write a :class:`CheckpointTensor` variable.

    Its ``write_offloaded_tensor`` reads the ``.pt`` file an ``OffloadedTensor`` normally has;
    ours has none, so the value is reloaded from the checkpoint and written the same way. The
    archive step copies through Python in 16 KiB pieces (a third of the export time on a 1 GB
    model); the same archive is written with larger copies.
    """
    from torch_to_nnef.nnef_io import writer

    original = writer.write_offloaded_tensor
    original_tgz = writer.tgz_compress

    def write(tensor: Any, filename: str, quantized: bool) -> None:
        if isinstance(tensor, CheckpointTensor) and tensor.source is not None and not quantized:
            write_dat_in_blocks(tensor, Path(filename), tensor.block_bytes or WRITE_BLOCK_BYTES)
            return
        original(tensor, filename, quantized)

    writer.write_offloaded_tensor = write
    writer.tgz_compress = _tgz_compress
    try:
        yield
    finally:
        writer.write_offloaded_tensor = original
        writer.tgz_compress = original_tgz


def read_in_blocks(module: torch.nn.Module, block_bytes: int | None) -> None:
    """Give every :class:`CheckpointTensor` of ``module`` its :attr:`~CheckpointTensor.
    block_bytes` (the export's ``MODELPREP_NNEF_BLOCK_BYTES``) and mark the input embedding's
    (transformers' ``get_input_embeddings()``) :attr:`~CheckpointTensor.looked_up_by_inputs`."""
    for tensor in module.state_dict(keep_vars=True).values():
        if isinstance(tensor, CheckpointTensor):
            tensor.block_bytes = block_bytes
    get_embeddings = getattr(module, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, CheckpointTensor):
        weight.looked_up_by_inputs = True


def _plain(tensor: Any) -> Any:
    """A weight torch-to-nnef offloaded, reloaded (a bias: one row's size); others as they are."""
    return tensor.reload() if isinstance(tensor, OffloadedTensor) else tensor


def _embedding_in_blocks(ids: torch.Tensor, weight: CheckpointTensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` gathering each block's rows as it is read: the same values,
    the weight never whole."""
    flat = ids.reshape(-1)
    out = torch.zeros((flat.numel(), *weight.elem.shape[1:]), dtype=weight.elem.dtype)
    for start, rows in weight.iter_rows():
        hit = (flat >= start) & (flat < start + rows.shape[0])
        if bool(hit.any()):
            out[hit] = rows[flat[hit] - start]
        del rows
    return out.reshape(*ids.shape, *weight.elem.shape[1:])


def _linear_in_blocks(x: torch.Tensor, weight: CheckpointTensor, bias: Any) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` a block of output rows at a time: each output element is
    the same dot product, the weight never whole."""
    bias = _plain(bias)
    pieces = []
    for start, rows in weight.iter_rows():
        part = None if bias is None else bias[start : start + rows.shape[0]]
        pieces.append(torch.nn.functional.linear(x, rows, part))
        del rows
    return torch.cat(pieces, dim=-1)


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` on a private anonymous mapping: pages read stay the kernel's shared
    zero page and count in no process's resident memory until written."""
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=math.prod(shape)).reshape(shape)


def nnef_dat_header(shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """The 128 bytes ``nnef.write_tensor`` writes before a non-quantized array's data."""
    from nnef import binary

    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    item_type, bits = binary._numpy_dtype_split(np_dtype)
    if len(shape) > binary.MaxTensorRank:
        raise ValueError(f"tensor rank exceeds {binary.MaxTensorRank}")
    count = int(np.prod(shape, dtype=np.int64))
    length = (count + 7) // 8 if bits == 1 else count * (bits // 8)
    words = [length, len(shape), *shape, *[0] * (binary.MaxTensorRank - len(shape))]
    words += [bits, item_type, *[0] * 19]
    return bytes([0x4E, 0xEF, 1, 0]) + np.asarray(words, dtype="<u4").tobytes()


def write_dat_in_blocks(
    tensor: CheckpointTensor, path: Path, max_bytes: int = WRITE_BLOCK_BYTES
) -> None:
    """Write ``tensor`` as the ``.dat`` file ``nnef.write_tensor`` writes, byte for byte: its
    header, then its value read, cast and written a block at a time
    (:meth:`CheckpointTensor.iter_blocks`), never whole."""
    shell: torch.Tensor = tensor.elem
    path.parent.mkdir(parents=True, exist_ok=True)
    if shell.dtype == torch.bool or sys.byteorder != "little":
        from nnef import write_tensor  # packed bits, or a byte swap: nnef's own writer, whole

        with path.open("wb") as f:
            write_tensor(file=f, tensor=np.asarray(tensor.reload().numpy(), order="C"))
        return
    written = 0
    with path.open("wb") as f:
        f.write(nnef_dat_header(tuple(shell.shape), shell.dtype))
        for block in tensor.iter_blocks(max_bytes):
            f.write(block.contiguous().numpy().data)
            written += block.numel()
            del block  # before the next block is read
    if written != shell.numel():
        raise ValueError(f"{tensor.source}: read {written} elements, expected {shell.numel()}")


METADATA_FUNCS = frozenset(
    {"is_floating_point", "is_complex", "dim", "size", "numel", "element_size"}
)
"""Tensor methods whose answer is the weight's dtype or shape, never its values."""


@contextlib.contextmanager
def metadata_from_shells() -> Iterator[None]:
    """Answer a wrapped weight's dtype and shape questions from its shell, not its values.

    Once torch-to-nnef wraps the module's weights for its trace, every call on one expands it
    (``opaque.trace_tensor_device_for_func(func)`` None: ``to_base_tensor``, a whole reload),
    and ``torch.jit.trace`` reads every attribute of every module, transformers' ``dtype``
    among them: ``next(p for p in parameters() if p.is_floating_point())``, the embedding,
    read whole four times on a Llama. The :data:`METADATA_FUNCS` go through the library's own
    ``"meta"`` placeholder instead."""
    from torch_to_nnef.tensor import opaque

    original = opaque.__dict__["trace_tensor_device_for_func"]

    def device_for(func: Any) -> str | None:
        if getattr(func, "__name__", "") in METADATA_FUNCS:
            return "meta"
        return original(func)  # type: ignore[no-any-return]

    opaque.trace_tensor_device_for_func = device_for
    try:
        yield
    finally:
        opaque.trace_tensor_device_for_func = original


@contextlib.contextmanager
def eager_q4_dequantize() -> Iterator[None]:
    """Run torch-to-nnef's q4_0 dequantization eagerly instead of through ``torch.compile``.

    It is a reshape, a subtract and a multiply; compiling it costs tens of seconds and hundreds
    of MB per export and writes an inductor cache under the system temp dir.
    """
    from torch_to_nnef.tensor.quant.base import QScalePerGroupF16

    original = QScalePerGroupF16.__dict__["_dequantize"]
    eager = getattr(QScalePerGroupF16, "_dequantize_original", None)
    if eager is not None:
        QScalePerGroupF16._dequantize = staticmethod(eager)
    try:
        yield
    finally:
        QScalePerGroupF16._dequantize = original


@contextlib.contextmanager
def cache_update_restored() -> Iterator[None]:
    """Leave transformers' KV-cache update methods as they were before torch-to-nnef ran.

    torch-to-nnef (0.24.12) patches ``DynamicLayer.update`` for its trace and never restores it;
    every later export in the same process (ONNX's dynamo capture) then traces the patched
    update, whose shapes do not follow the cache's dynamic axes."""
    from torch_to_nnef_llm.models import base
    from transformers import cache_utils

    saved = [
        (owner, "update", owner.__dict__["update"])
        for owner in (cache_utils.DynamicLayer, cache_utils.DynamicCache)
        if "update" in owner.__dict__
    ]
    saved.append((base, "_force_dyn_layer_update_ge4_56", base._force_dyn_layer_update_ge4_56))
    base._force_dyn_layer_update_ge4_56 = _initialized_layer_update
    try:
        yield
    finally:
        for owner, name, method in saved:
            setattr(owner, name, method)


def _initialized_layer_update(
    self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch-to-nnef's tract-friendly ``DynamicLayer.update`` (no concat with an empty first
    cache) that also marks the layer initialized, as transformers' own update does."""
    if not self.is_initialized:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states, value_states
        self.is_initialized = True
    else:
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
    return self.keys, self.values


@contextlib.contextmanager
def sliding_window_masks() -> Iterator[None]:
    """Give a sliding-window decoder its window in torch-to-nnef's traced mask (see the module
    docstring); a model without a sliding window keeps the library's mask untouched."""
    from torch_to_nnef_llm.models.handlers.default import DefaultArchitectureHandler

    original = DefaultArchitectureHandler.__dict__["build_forward_inputs"]

    def build_forward_inputs(self: Any, *, inputs: tuple[Any, ...], wrapper: Any) -> Any:
        built = original(self, inputs=inputs, wrapper=wrapper)
        config = wrapper.model.config
        window = getattr(config, "sliding_window", None)
        mask = built.model_inputs.get("attention_mask")
        if window is None or not isinstance(mask, torch.Tensor):
            return built
        windowed = _windowed_mask(mask, int(window))
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # Mistral: one kind of layer, all sliding
            built.model_inputs["attention_mask"] = windowed
        elif "sliding_attention" in layer_types:
            built.model_inputs["attention_mask"] = {
                "full_attention": mask,
                "sliding_attention": windowed,
            }
        return built

    DefaultArchitectureHandler.build_forward_inputs = build_forward_inputs
    try:
        yield
    finally:
        DefaultArchitectureHandler.build_forward_inputs = original


@contextlib.contextmanager
def cache_heads_from_config() -> Iterator[None]:
    """Give torch-to-nnef's LLM exporter the number of key/value heads the model's cache holds
    where its config helper cannot read it (see the module docstring): Falcon's and
    GPT-NeoX's. Other models keep the library's answer."""
    from torch_to_nnef_llm.config import HFConfigHelper

    original = HFConfigHelper.__dict__["get_num_kv_heads"]

    def get_num_kv_heads(self: Any, layer_idx: int) -> Any:
        heads = cached_kv_heads(self.decoder_conf)
        return original(self, layer_idx) if heads is None else heads

    HFConfigHelper.get_num_kv_heads = get_num_kv_heads
    try:
        yield
    finally:
        HFConfigHelper.get_num_kv_heads = original


def cached_kv_heads(config: Any) -> int | None:
    """The key/value heads per layer in the cache of a model whose config torch-to-nnef reads
    wrongly, None for the others: Falcon caches every head with its new decoder architecture
    (``FalconAttention`` repeats the KV groups before the cache), one with ``multi_query``,
    else ``num_kv_heads``; GPT-NeoX has one key/value head per attention head and no
    ``num_key_value_heads``."""
    if getattr(config, "model_type", None) == "falcon":
        if config.new_decoder_architecture:
            return int(config.num_attention_heads)
        return 1 if config.multi_query else int(config.num_kv_heads)
    if getattr(config, "model_type", None) == "gpt_neox":
        return int(config.num_attention_heads)
    return None


@contextlib.contextmanager
def moe_experts_offloaded(offload_dir: Path) -> Iterator[None]:
    """Write each expert stack torch-to-nnef's MoE extractor cuts to ``offload_dir`` as it cuts
    it, instead of holding every layer's in the graph until the archive is written (the
    library does so only for stacks it quantized, under ``T2N_OFFLOAD_QUANTIZED_EXPERTS``):
    the export then holds one layer's experts at a time, as it holds one tensor of a dense
    model. The NNEF writer writes an ``OffloadedTensor`` variable from its file."""
    from torch_to_nnef.op.custom_extractors import moe

    original = moe.__dict__["_maybe_quantize_expert_weight"]

    def offloaded(node: Any, name: str, data: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(node, name, data, *args, **kwargs)
        if name not in EXPERT_STACKS or isinstance(out, OffloadedTensor) or out is not data:
            return out  # a router, a bias, or a stack the library quantized or offloaded
        stack = OffloadedTensor.from_original_tensor(
            data.contiguous(), f"{node.outputs[0].name}_{name}", offload_dir=offload_dir
        )
        stack.nnef_name = f"{node.outputs[0].name}_{name}"
        return stack

    moe._maybe_quantize_expert_weight = offloaded
    try:
        yield
    finally:
        moe._maybe_quantize_expert_weight = original


EXPERT_STACKS = frozenset({"w1", "w2", "w3"})
"""The names torch-to-nnef's MoE extractor gives the expert stacks it cuts (gate, down, up)."""


def _windowed_mask(causal: torch.Tensor, window: int) -> torch.Tensor:
    """The additive mask of ``causal``'s shape (``[1, 1, S, P+S]``, the S queries at positions
    P..P+S-1) for a sliding window: a query sees itself and the ``window - 1`` keys before it,
    as in transformers. Built from positions, as the library builds ``causal``, so the traced
    graph holds for any S and P."""
    queries, keys = causal.shape[-2], causal.shape[-1]
    q_pos = torch.arange(keys - queries, keys).unsqueeze(1)
    k_pos = torch.arange(keys).unsqueeze(0)
    hidden = ((k_pos > q_pos) | (k_pos <= q_pos - window)).to(causal.dtype)
    return (torch.full_like(causal, torch.finfo(causal.dtype).min) * hidden).to(causal.dtype)


@contextlib.contextmanager
def job_tempdir(path: Path) -> Iterator[Path]:
    """Point ``tempfile`` (torch-to-nnef's ``mkdtemp``/``TemporaryDirectory``) at ``path``.

    torch-to-nnef stages archives and offload files in ``tempfile.mkdtemp()`` directories and
    does not always remove them; the job process is dedicated, so the process-wide
    ``tempfile.tempdir`` can be redirected for the block and the whole directory removed after.
    """
    path.mkdir(parents=True, exist_ok=True)
    previous = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(path, ignore_errors=True)


