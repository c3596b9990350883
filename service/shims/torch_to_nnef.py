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

The patches are context managers: a job process enters them around an export and leaves them
as they were. This module imports torch and torch-to-nnef at import time: import it inside
functions.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
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


class CheckpointTensor(OffloadedTensor):  # type: ignore[misc]
    """An ``OffloadedTensor`` whose payload is the checkpoint's own bytes.

    ``source`` is the stored tensor name; once torch-to-nnef rewrites the values
    (``update_values``) it becomes None and the parent's ``.pt`` file in ``offload_dir`` is used.
    """

    elem: torch.Tensor
    reader: TensorSource
    source: str | None
    hook: ReloadHook | None

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
        if isinstance(tensor, CheckpointTensor) and tensor.source is not None:
            value = tensor.reload()
            writer.write_nnef_tensor(
                np.asarray(writer.maybe_torch_to_np(value), order="C"), filename, quantized
            )
            del value
            return
        original(tensor, filename, quantized)

    writer.write_offloaded_tensor = write
    writer.tgz_compress = _tgz_compress
    try:
        yield
    finally:
        writer.write_offloaded_tensor = original
        writer.tgz_compress = original_tgz


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


