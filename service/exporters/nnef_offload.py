"""The job's meta-built model with every weight offloaded, as torch-to-nnef ``OffloadedTensor``s.

torch-to-nnef's own on-disk loader (``t2n_load_checkpoint_and_dispatch``) loads a whole shard into
RAM, then copies every tensor into a ``.pt`` file of an offload directory made with
``tempfile.mkdtemp`` and never removed; its ``.bin`` path falls back to unrestricted unpickling.
Here an export takes a copy of the job's one meta build and each weight becomes a
:class:`CheckpointTensor` that re-reads its bytes from the job's offload store (which, for a
safetensors checkpoint, points into the shards themselves) or through the project's
:class:`~service.checkpoint.base.WeightReader` (``pread`` into a fresh tensor, nothing left
resident) every time torch-to-nnef touches it.

Everything torch-to-nnef itself still writes (offloaded q4_0 blocks, archive staging) lands in
an ``offload_dir``/``TMPDIR`` owned by the job (:func:`job_tempdir`), and every ``torch.load`` it
makes runs weights-only (:func:`weights_only_unpickling`).

This module imports torch and torch-to-nnef at import time: import it inside functions.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
from torch import nn
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.updater import ModTensorUpdater

from service.checkpoint.base import Checkpoint, WeightReader
from service.errors import CheckpointError, NoModelConfig, UnsafePickle, UnsupportedExport

if TYPE_CHECKING:
    from service.offload.store import OffloadStore

LOGGER = logging.getLogger(__name__)

ModelKind = Literal["causal_lm", "encoder"]
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

    def update_values(
        self, values: torch.Tensor, strict_shape: bool = True, strict_dtype: bool = True
    ) -> None:
        if self.source is not None:
            self.source = None
            strict_dtype = False  # there is no previous .pt payload to compare with
        super().update_values(values, strict_shape=strict_shape, strict_dtype=strict_dtype)


@dataclass
class OffloadedModel:
    module: nn.Module
    kind: ModelKind
    config: Any
    """The transformers ``PretrainedConfig``."""
    dtype: torch.dtype
    """Floating dtype of the exported weights."""
    weight_bytes: int


def export_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """float16 stays float16; float32 and bfloat16 (poorly supported by tract on CPU) -> float32."""
    floats = [i for i in checkpoint.reader.tensor_infos() if i.dtype.is_floating_point]
    if floats and max(floats, key=lambda i: i.nbytes).dtype == torch.float16:
        return torch.float16
    return torch.float32


def model_kind(config: dict[str, Any]) -> ModelKind:
    """Causal LMs go through torch-to-nnef's LLM exporter (KV cache I/O), the rest as encoders."""
    architectures = config.get("architectures") or []
    if any(
        isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures
    ):
        return "causal_lm"
    return "encoder"


def offloaded_model(
    skeleton: nn.Module,
    checkpoint: Checkpoint,
    *,
    offload_dir: Path,
    store: OffloadStore | None = None,
    hook: ReloadHook | None = None,
    dtype: torch.dtype | None = None,
) -> OffloadedModel:
    """A private copy of the job's meta-built ``skeleton`` whose weights are all offloaded.

    torch-to-nnef rewrites the module it exports (q4_0 weights, tracing wrappers), so each
    export gets its own deep copy of the one meta build (no data: a 70B skeleton copies in a
    tenth of a second). Weights are read from the job's offload ``store`` where it holds them,
    else from the checkpoint. Buffers computed at construction (rotary ``inv_freq``, BERT
    ``position_ids``) are real CPU tensors and are copied as they are. Raises
    :class:`NoModelConfig` without a config, :class:`UnsupportedExport` when the skeleton is not
    the kind of model the config names, :class:`CheckpointError` when a weight is missing or of
    another shape. Floating weights are cast to ``dtype`` on read (default: :func:`export_dtype`).
    """
    if checkpoint.config is None:
        raise NoModelConfig("NNEF export builds the model graph and needs a config.json")
    kind = model_kind(checkpoint.config)
    if kind == "causal_lm" and not _is_causal_lm(skeleton):
        raise UnsupportedExport(
            f"config.json names a causal LM, but the checkpoint's weights fit "
            f"{type(skeleton).__name__}, which has no language-model head"
        )
    module = copy.deepcopy(skeleton)
    module.eval()
    set_attn = getattr(module, "set_attn_implementation", None)
    if callable(set_attn):
        set_attn("eager")  # torch-to-nnef traces the eager attention, not sdpa's kernel
    # torch-to-nnef writes _name_or_path into the archive properties: keep host paths out.
    config: Any = module.config
    config._name_or_path = checkpoint.root.name
    dtype = dtype or export_dtype(checkpoint)
    weight_bytes = attach_offloaded_weights(
        module, checkpoint.reader, offload_dir, dtype, store=store, hook=hook
    )
    return OffloadedModel(module, kind, config, dtype, weight_bytes)


def _is_causal_lm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("ForCausalLM", "LMHeadModel"))


class _StoreWeights:
    """The job's offload store read like a checkpoint: by the module's tensor names."""

    def __init__(self, store: OffloadStore) -> None:
        self.store = store

    def read(self, name: str) -> torch.Tensor:
        return self.store.load(name)


def attach_offloaded_weights(
    module: nn.Module,
    reader: WeightReader,
    offload_dir: Path,
    dtype: torch.dtype,
    *,
    store: OffloadStore | None = None,
    hook: ReloadHook | None = None,
) -> int:
    """Replace every meta tensor of ``module`` by a :class:`CheckpointTensor`; returns bytes mapped.

    A tensor the offload ``store`` holds (under the module's canonical, untied name, as
    :func:`service.offload.dispatch.dispatch_checkpoint` puts it) is read from there. Others
    are matched in the checkpoint as stored, through the reader's aliases, then with the
    model's ``base_model_prefix`` removed or added (a ``BertForMaskedLM`` checkpoint into
    ``BertModel``).
    """
    from service.offload.build import tied_names

    infos = {i.name: i for i in reader.tensor_infos()}
    aliases = reader.aliases()
    prefix = getattr(module, "base_model_prefix", "") or ""
    tied = tied_names(module)
    def source_of(name: str) -> tuple[TensorSource, str, tuple[int, ...], torch.dtype] | None:
        canonical = tied.get(name, name)
        if store is not None and canonical in store:
            entry = store.entry(canonical)
            return _StoreWeights(store), canonical, entry.shape, entry.torch_dtype
        candidates = [name]
        if prefix:
            candidates += [name.removeprefix(prefix + "."), f"{prefix}.{name}"]
        for candidate in candidates:
            if candidate not in infos and aliases.get(candidate) in infos:
                candidate = aliases[candidate]
            if candidate in infos:
                info = infos[candidate]
                return reader, candidate, tuple(info.shape), info.dtype
        return None

    updater = ModTensorUpdater(
        module, add_parameter_if_unset=True, add_buffers=True, add_unregistred_tensor=True
    )
    done: set[int] = set()
    missing: list[str] = []
    total = 0
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta" or id(tensor) in done:
            continue
        found = source_of(name)
        if found is None:
            missing.append(name)
            continue
        source_reader, source, shape, stored_dtype = found
        if shape != tuple(tensor.shape):
            raise CheckpointError(
                f"weight {source} has shape {list(shape)}, the model expects "
                f"{list(tensor.shape)} for {name}"
            )
        target = dtype if stored_dtype.is_floating_point else stored_dtype
        replacement = CheckpointTensor.create(
            source_reader, source, name, shape, target, offload_dir, hook
        )
        done.add(id(tensor))
        updater.update_by_name(name, replacement, enforce_tensor_consistency=False)
        total += math.prod(shape) * target.itemsize
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise CheckpointError(f"checkpoint lacks {len(missing)} weights of the model: {shown}")
    return total


# --- guards around torch-to-nnef --------------------------------------------------------------


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


class TensorOutputs(nn.Module):
    """Positional tensors in, a tuple of tensors out: the form ``export_model_to_nnef`` traces.

    ``input_names`` start as the wrapped forward's parameters (the caller keeps those it feeds);
    ``output_names`` are the tensor fields of the model output, known after the first call.
    """

    def __init__(self, model: nn.Module) -> None:
        import inspect

        super().__init__()
        self.model = model
        self.input_names: list[str] = list(inspect.signature(model.forward).parameters)
        self.output_names: list[str] = []

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kwargs = dict(zip(self.input_names, tensors, strict=True))
        out = self.model(**kwargs, return_dict=True)
        fields = [(k, v) for k, v in out.items() if isinstance(v, torch.Tensor)]
        self.output_names = [k for k, _ in fields]
        return tuple(v for _, v in fields)
