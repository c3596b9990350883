"""A meta-built model whose weights stay in the checkpoint, as torch-to-nnef ``OffloadedTensor``s.

torch-to-nnef's own on-disk loader (``t2n_load_checkpoint_and_dispatch``) loads a whole shard into
RAM, then copies every tensor into a ``.pt`` file of an offload directory made with
``tempfile.mkdtemp`` and never removed; its ``.bin`` path falls back to unrestricted unpickling.
Here the checkpoint itself is the offload store: each parameter is a :class:`CheckpointTensor`
that re-reads its bytes through the project's :class:`~service.checkpoint.base.WeightReader`
(``pread`` into a fresh tensor, nothing left resident) every time torch-to-nnef touches it.

Everything torch-to-nnef itself still writes (offloaded q4_0 blocks, archive staging) lands in
an ``offload_dir``/``TMPDIR`` owned by the job (:func:`job_tempdir`), and every ``torch.load`` it
makes runs weights-only (:func:`weights_only_unpickling`).

This module imports torch and torch-to-nnef at import time: import it inside functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.updater import ModTensorUpdater

from service.checkpoint.base import Checkpoint, WeightReader
from service.errors import CheckpointError, NoModelConfig, UnsafePickle, UnsupportedExport

LOGGER = logging.getLogger(__name__)

ModelKind = Literal["causal_lm", "encoder"]
ReloadHook = Callable[[int], None]
"""Called with the byte size of every weight read: progress, metrics, cancellation."""


class CheckpointTensor(OffloadedTensor):  # type: ignore[misc]
    """An ``OffloadedTensor`` whose payload is the checkpoint's own bytes.

    ``source`` is the stored tensor name; once torch-to-nnef rewrites the values
    (``update_values``) it becomes None and the parent's ``.pt`` file in ``offload_dir`` is used.
    """

    elem: torch.Tensor
    reader: WeightReader
    source: str | None
    hook: ReloadHook | None

    @classmethod
    def create(
        cls,
        reader: WeightReader,
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


def _architecture_class(config: dict[str, Any]) -> Any:
    """The transformers class named by ``architectures[0]``, when transformers has it."""
    import transformers

    architectures = config.get("architectures") or []
    if not architectures or not isinstance(architectures[0], str):
        return None
    cls = getattr(transformers, architectures[0], None)
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return cls
    return None


def build_offloaded_model(
    checkpoint: Checkpoint,
    *,
    trust_remote_code: bool,
    offload_dir: Path,
    hook: ReloadHook | None = None,
) -> OffloadedModel:
    """Build the model on ``meta`` and point every weight at the checkpoint (no data is read).

    Buffers computed at construction (rotary ``inv_freq``, BERT ``position_ids``) stay real CPU
    tensors. Raises :class:`NoModelConfig` without a config and :class:`CheckpointError` when the
    checkpoint lacks a weight the model needs or stores it with another shape.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if checkpoint.config is None:
        raise NoModelConfig("NNEF export builds the model graph and needs a config.json")
    kind = model_kind(checkpoint.config)
    try:
        config = AutoConfig.from_pretrained(
            str(checkpoint.root.resolve()),
            trust_remote_code=trust_remote_code,
            local_files_only=True,
        )
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedExport(f"cannot build a model from config.json: {exc}") from exc
    dtype = export_dtype(checkpoint)
    try:
        with init_empty_weights(include_buffers=False):
            kwargs: dict[str, Any] = {"attn_implementation": "eager", "dtype": dtype}
            named = _architecture_class(checkpoint.config) if kind == "encoder" else None
            if named is not None:
                # The checkpoint's own head (BertForMaskedLM...): its weights are all there.
                module = named._from_config(config, **kwargs)
            else:
                auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModel
                module = auto.from_config(  # type: ignore[no-untyped-call]
                    config, trust_remote_code=trust_remote_code, **kwargs
                )
    except (ValueError, KeyError, ImportError) as exc:
        raise UnsupportedExport(
            f"architecture {config.model_type!r} cannot be built: {exc}"
        ) from exc
    module.eval()
    if hasattr(module, "tie_weights"):
        # Tied weights (tie_word_embeddings) are stored once: make them one tensor before
        # pointing it at the checkpoint, as from_pretrained would.
        module.tie_weights()
    # torch-to-nnef writes _name_or_path into the archive properties: keep host paths out.
    module.config._name_or_path = checkpoint.root.name
    weight_bytes = attach_checkpoint_weights(module, checkpoint.reader, offload_dir, dtype, hook)
    return OffloadedModel(module, kind, config, dtype, weight_bytes)


def attach_checkpoint_weights(
    module: nn.Module,
    reader: WeightReader,
    offload_dir: Path,
    dtype: torch.dtype,
    hook: ReloadHook | None = None,
) -> int:
    """Replace every meta tensor of ``module`` by a :class:`CheckpointTensor`; returns bytes mapped.

    Names are matched as stored, through the reader's aliases, then with the model's
    ``base_model_prefix`` removed or added (a ``BertForMaskedLM`` checkpoint into ``BertModel``).
    """
    infos = {i.name: i for i in reader.tensor_infos()}
    aliases = reader.aliases()
    prefix = getattr(module, "base_model_prefix", "") or ""

    def source_of(name: str) -> str | None:
        candidates = [name]
        if prefix:
            candidates += [name.removeprefix(prefix + "."), f"{prefix}.{name}"]
        for candidate in candidates:
            if candidate in infos:
                return candidate
            if candidate in aliases and aliases[candidate] in infos:
                return aliases[candidate]
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
        source = source_of(name)
        if source is None:
            missing.append(name)
            continue
        info = infos[source]
        if tuple(info.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"weight {source} has shape {list(info.shape)}, the model expects "
                f"{list(tensor.shape)} for {name}"
            )
        target = dtype if info.dtype.is_floating_point else info.dtype
        replacement = CheckpointTensor.create(
            reader, source, name, tuple(info.shape), target, offload_dir, hook
        )
        done.add(id(tensor))
        updater.update_by_name(name, replacement, enforce_tensor_consistency=False)
        total += info.numel * target.itemsize
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
