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
an ``offload_dir``/``TMPDIR`` owned by the job, and every ``torch.load`` it makes runs
weights-only: the patches that ensure it are in :mod:`service.shims.torch_to_nnef`.

This module imports torch and torch-to-nnef at import time: import it inside functions.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch_to_nnef.tensor.updater import ModTensorUpdater

from service.checkpoint.base import Checkpoint, WeightReader
from service.errors import CheckpointError, NoModelConfig, UnsupportedExport
from service.exporters.common.families import is_causal_lm
from service.shims.torch_to_nnef import CheckpointTensor, ReloadHook, TensorSource

if TYPE_CHECKING:
    from service.offload.store import OffloadStore
    from service.stage import JobContext

LOGGER = logging.getLogger(__name__)

ModelKind = Literal["causal_lm", "encoder"]
@dataclass
class OffloadedModel:
    module: nn.Module
    kind: ModelKind
    config: Any
    """The transformers ``PretrainedConfig``."""
    dtype: torch.dtype
    """Floating dtype of the exported weights."""
    weight_bytes: int


def read_hook(ctx: JobContext, metric: str) -> Callable[[int], None]:
    """Called after each weight is read: progress, cancellation, the ``metric`` of bytes read,
    and the freed heap handed back (earlier reloads were written and freed by now)."""
    from service.memory.heap import HeapTrimmer

    trim = HeapTrimmer()

    def on_read(nbytes: int) -> None:
        ctx.check_abort()
        ctx.advance(nbytes)
        ctx.add_metric(metric, nbytes)
        trim(nbytes)

    return on_read


@contextmanager
def page_cache_kept(reader: Any) -> Iterator[None]:
    """Tracing, writing and verifying read every weight several times: keep those reads in the
    page cache (reclaimable, not process memory) instead of the reader's single-pass eviction
    (a reader that drops pages after each read stops doing so for the duration)."""
    drop_page_cache = getattr(reader, "drop_page_cache", None)
    if isinstance(drop_page_cache, bool):
        reader.drop_page_cache = False
    try:
        yield
    finally:
        if isinstance(drop_page_cache, bool):
            reader.drop_page_cache = drop_page_cache


def export_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """float16 stays float16; float32 and bfloat16 (poorly supported by tract on CPU) -> float32."""
    floats = [i for i in checkpoint.reader.tensor_infos() if i.dtype.is_floating_point]
    if floats and max(floats, key=lambda i: i.nbytes).dtype == torch.float16:
        return torch.float16
    return torch.float32


def model_kind(config: dict[str, Any]) -> ModelKind:
    """Causal LMs are exported with their KV cache I/O, the rest as encoders."""
    return "causal_lm" if is_causal_lm(config) else "encoder"


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
    if dtype is None and kind == "encoder":
        # torch-to-nnef's traced path (not the LLM exporter) breaks on a float16 encoder: real
        # all-MiniLM in float16 fails in aten.layer_norm on a float32 activation holding
        # garbage. Encoders are small; they export (and run in tract) in float32.
        dtype = torch.float32
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

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        """The weight flattened, in pieces of at most ``max_bytes`` stored bytes (a packed
        entry: blocks of its rows, dequantized), for the NNEF writer's blocks."""
        if self.store.entry(name).encoding == "raw":
            yield from self.store.iter_chunks(name, max_bytes)
            return
        rows = self.store.entry(name).shape[0]
        step = max(1, max_bytes // max(1, self.store.row_nbytes(name)))
        for start in range(0, rows, step):
            yield self.store.load_rows(name, start, min(rows, start + step)).reshape(-1)


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
    from service.checkpoint.experts import as_model_names
    from service.offload.build import tied_names
    from service.shims.transformers_keys import key_renamer

    # A mixture of experts stored one tensor per expert is read as the model's packed stacks
    # (the weights a job kept in RAM are not in its store, so they come from here too).
    reader = as_model_names(reader, module)
    infos = {i.name: i for i in reader.tensor_infos()}
    aliases = reader.aliases()
    # transformers' own renames at load (GPT-NeoX's embed_out is lm_head), as dispatch applies
    rename = key_renamer(module)
    renamed = {rename(n): n for n in infos if rename(n) != n}
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
            if candidate not in infos and renamed.get(candidate) in infos:
                candidate = renamed[candidate]
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
