"""The checkpoint as transformers' own ``from_pretrained`` reads it: the job's independent reference.

Every check of an artifact compares it with a reference. Computed by the job's own reader and
offload store, that reference shares any misreading of the source with the artifact (raw FP8
codes read as weights pass every such check). So once per job the reference comes from an
implementation that is not ours: transformers' ``AutoModelForCausalLM.from_pretrained`` of the
checkpoint directory, which implements the quantization configs it knows (block-scaled FP8 is
dequantized by its ``Fp8Dequantize``, bit for bit what ``service.checkpoint.fp8`` does).

* **whole**: the model fits the job's memory budget in float32: loaded in its dtype, cast to
  float32, run on the inputs.
* **layer-by-layer**: it does not: the same ``from_pretrained`` with a device map that leaves
  the layer stack on ``disk`` (:func:`layers_on_disk`) and an ``offload_folder`` in the job's work
  directory, so accelerate's hooks load each layer's weights when it runs, cast to float32 as
  it loads them: computed in float32, as whole (in the model's own dtype the reference, not the
  artifact, would be the larger error). transformers' own forward runs every layer, mask and norm. Only the two
  vocabulary-sized matrices are not loaded: a plain input embedding gathers the rows of the
  input's token ids (:class:`MappedEmbedding`) and a plain output head multiplies by a block of
  vocabulary rows at a time, upcast to float32 (:class:`MappedHead`), both read from the
  memory-mapped safetensors file by the ``safetensors`` library (the file as published, not
  the job's reader). So the peak is one layer plus small buffers, whatever vocab x hidden is.
  An embedding or head of another kind (scaled, quantized, adapted) stays resident.

What it produces: the outputs on the fixed input ids (:func:`fixed_input_ids`, what the parity
checks compare), and the logits on the chunks of the fixed text (``service.verification.logits``:
KL, top-1 and perplexity ratio of each artifact). The manifest says which mode and version.

A reader beside the job's own (``service.checkpoint.open_checkpoint``), and its check: the job
compares what its offloaded model computes with this before any artifact is judged.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.errors import ReferenceUnavailable, VerificationFailed
from service.verification.logits import chunk_tokens, scored

FIXED_TEXT_CTX = 128
"""Tokens per chunk of the fixed text (two chunks are scored: 126 positions)."""
FIXED_TEXT_CHUNKS = 2


@dataclass
class IndependentReference:
    """transformers' reading of the source, on the job's fixed inputs."""

    implementation: str
    version: str
    mode: str
    outputs: Any
    """float32 torch tensor: the model's output on the fixed input ids (None when the job
    asked only for the fixed text's logits: ``with_outputs=False``)."""
    chunks: np.ndarray | None = None
    """The fixed text's tokens ``(n_chunk, n_ctx)``, None for a model without a tokenizer."""
    logits_dir: Path | None = None
    """``chunk-<i>.npy``: float32 logits ``(n_ctx, vocab)`` of each chunk (rows outside
    ``service.verification.logits.scored`` are zero)."""
    vocab_size: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def chunk_logits(self) -> list[np.ndarray]:
        """Each chunk's logits, memory-mapped from the work directory."""
        assert self.chunks is not None and self.logits_dir is not None
        return [np.load(self.logits_dir / f"chunk-{i}.npy", mmap_mode="r") for i in range(len(self.chunks))]

    def summary(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "version": self.version,
            "mode": self.mode,
            "fixed_text_positions": 0 if self.chunks is None else len(self.chunks) * (FIXED_TEXT_CTX // 2 - 1),
            **self.info,
        }


def text_chunks(source_dir: Path, text: str) -> np.ndarray | None:
    """The fixed text's first :data:`FIXED_TEXT_CHUNKS` chunks as the source's tokenizer cuts
    them, each starting with its BOS when it has one (llama.cpp adds it where its vocabulary
    says so; placed here, both sides see it whatever the vocabulary says); None without one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < FIXED_TEXT_CTX * FIXED_TEXT_CHUNKS:
        ids = (ids * (FIXED_TEXT_CTX * FIXED_TEXT_CHUNKS // max(1, len(ids)) + 1))
    ids = ids[: FIXED_TEXT_CTX * FIXED_TEXT_CHUNKS]
    return chunk_tokens(ids, FIXED_TEXT_CTX, tokenizer.bos_token_id)


def independent_reference(
    source_dir: Path,
    model_class: Any,
    input_ids: Any,
    text: str,
    max_memory_bytes: int,
    work: Path,
    adapter_dir: Path | None = None,
    merge_adapter: bool = True,
    with_outputs: bool = True,
) -> IndependentReference:
    """transformers' outputs for ``input_ids`` and, for a causal LM, its logits on ``text``,
    within the budget; ``model_class`` the transformers class the job built (the one
    config.json names), loaded by its own ``from_pretrained``; with ``adapter_dir``, the PEFT
    LoRA adapter there merged into it by PEFT (``merge_adapter``), or run beside it by PEFT's
    ``PeftModel`` (the reference of an adapter kept apart).

    ``with_outputs=False`` skips the forward on ``input_ids`` for a job whose checks read only
    the fixed text's logits (a GGUF's llama.cpp run, nothing compared with the job's own model):
    layer by layer, that pass reads every weight from disk again for an output no one reads
    (8 tokens: about a fifth of the reference's time on a 3.7 GB checkpoint)."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source_dir), local_files_only=True)
    causal = model_class.__name__.endswith("ForCausalLM")
    params = _parameter_count(source_dir)
    whole = params * 4 <= max_memory_bytes
    kwargs: dict[str, Any] = {"dtype": "auto", "local_files_only": True}
    offload = work / "reference-offload"
    mapped: dict[str, _StoredTensor] = {}
    if not whole:
        device_map, mapped = layers_on_disk(
            model_class, config, None if adapter_dir is not None else source_dir
        )
        kwargs.update(device_map=device_map, offload_folder=str(offload))
    model: Any
    try:
        model = model_class.from_pretrained(str(source_dir), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ReferenceUnavailable(
            f"transformers' from_pretrained, the job's independent reference, cannot load the "
            f"source: {type(exc).__name__}: {exc}"
        ) from exc
    if adapter_dir is not None:
        model = _with_peft(model, adapter_dir, merge_adapter)
    # float32 in both modes: nn.Module's own cast (transformers' refuses a model it calls
    # quantized, a config naming a method over float weights is, though every weight here is a
    # float tensor). Layer by layer, the layers' weights are on meta until accelerate loads each
    # and casts it to its parameter's dtype, float32 from here: the reference computes in
    # float32 whatever the source's dtype. In bfloat16 it would be no reference for an f16
    # artifact: through Qwen2.5-0.5B's 24 layers bfloat16's rounding alone is KL 0.14 from
    # float32, where the f16 GGUF is 0.0002 (docs/exports.md). Cast before the mapped
    # stand-ins replace the embedding and head: they take the dtype of what they replace.
    model = torch.nn.Module.float(model)
    for path, stored in mapped.items():
        _replace_module(model, path, stored)
    model.eval()
    chunks = text_chunks(source_dir, text) if causal else None
    logits_dir = work / "reference-logits"
    logits_dir.mkdir(parents=True, exist_ok=True)
    window = scored(FIXED_TEXT_CTX)
    try:
        with torch.inference_mode():
            outputs = _outputs(model, model_class, input_ids) if with_outputs else None
            if chunks is not None:
                _chunk_logits(model, chunks, logits_dir, window)
    finally:
        del model
        shutil.rmtree(offload, ignore_errors=True)
    peft = "" if adapter_dir is None else " + peft." + (
        "merge_and_unload" if merge_adapter else "PeftModel"
    )
    return IndependentReference(
        implementation=f"transformers.{model_class.__name__}.from_pretrained{peft}",
        version=transformers.__version__,
        mode="whole" if whole else "layer-by-layer",
        outputs=outputs,
        chunks=chunks,
        logits_dir=logits_dir if chunks is not None else None,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        info={
            "compute_dtype": "float32",
            **({"mapped_from_file": sorted(mapped)} if mapped else {}),
        },
    )


def _outputs(model: Any, model_class: Any, input_ids: Any) -> Any:
    """The model's float32 output (logits, else last hidden state) on ``input_ids``."""
    import torch

    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    found = getattr(out, "logits", None)
    found = getattr(out, "last_hidden_state", None) if found is None else found
    if not isinstance(found, torch.Tensor):
        raise VerificationFailed(f"{model_class.__name__} gives no logits or hidden state")
    return found.float().clone()


def _chunk_logits(model: Any, chunks: np.ndarray, logits_dir: Path, window: slice) -> None:
    """A causal LM's logits on every chunk of the fixed text (``chunk-<i>.npy``), from one
    forward over the chunks as a batch: layer by layer, every forward reads every weight from
    disk again, so one pass instead of one per chunk. (The fixed input is shorter: batched, its
    padding would cost more compute than the pass it saves.)"""
    import torch

    ids = torch.from_numpy(chunks.astype(np.int64))
    logits = model(input_ids=ids, use_cache=False).logits
    for i in range(len(chunks)):
        _save_chunk(logits[i].float().numpy(), logits_dir / f"chunk-{i}.npy", window)


def _save_chunk(logits: np.ndarray, path: Path, window: slice) -> None:
    """A chunk's logits with the rows outside the scored window (and the one before it) zeroed."""
    kept = np.zeros_like(logits)
    kept[window.start - 1 : window.stop] = logits[window.start - 1 : window.stop]
    np.save(path, kept)


def _with_peft(model: Any, adapter_dir: Path, merge: bool) -> Any:
    """``model`` with the LoRA adapter in ``adapter_dir`` merged by PEFT's own
    ``merge_and_unload`` (the reference for a job that merges it while reading), or unmerged,
    PEFT's ``PeftModel`` computing ``W x + scale * B A x`` (for an adapter kept apart; the
    mapped embedding and head stand-ins are not used with an adapter)."""
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
        return peft_model.merge_and_unload() if merge else peft_model
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ReferenceUnavailable(
            f"PEFT, the job's independent reference for the adapter, cannot merge it: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _parameter_count(source_dir: Path) -> int:
    """Elements of every stored tensor, from the safetensors headers (0 when unknown: the
    model is then loaded whole and the budget judged by the job's own measures)."""
    from service.checkpoint.consistency import safetensors_tensors

    tensors = safetensors_tensors(source_dir) or {}
    total = 0
    for _, shape in tensors.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def layers_on_disk(
    model_class: Any, config: Any, source_dir: Path | None = None
) -> tuple[dict[str, str], dict[str, _StoredTensor]]:
    """A device map with every block of the model's layer stack on ``disk`` (accelerate loads
    each when it runs) and the rest (final norm, small buffers) in RAM, and the vocabulary-sized
    modules read from ``source_dir``'s files instead (:func:`_mappable`: on ``disk`` too, never
    loaded, replaced after loading; None: none, they stay in RAM). accelerate's own ``"auto"``
    map puts a tied embedding on disk under one name and looks it up under the other (KeyError
    on SmolLM2 with transformers 5)."""
    from accelerate import init_empty_weights

    model: Any
    with init_empty_weights():
        model = model_class(config)
    mapped = _mappable(model, source_dir) if source_dir is not None else {}
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        return {"": "disk"}, {}
    path, stack = max(stacks, key=lambda item: len(item[1]))
    device_map = {f"{path}.{i}": "disk" for i in range(len(stack))}
    parts = path.split(".")
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        module = model.get_submodule(parent) if parent else model
        for name, _ in module.named_children():
            if name != parts[depth]:
                device_map[f"{parent}.{name}" if parent else name] = "cpu"
    for name in mapped:  # finer than its parent's entry: accelerate takes the longest prefix
        device_map[name] = "disk"
    return device_map, mapped


@dataclass(frozen=True)
class _StoredTensor:
    """A vocabulary-sized matrix where the published safetensors file holds it."""

    kind: str
    """``embedding`` (gathered by token id) or ``head`` (multiplied a block of rows at a time)."""
    file: Path
    key: str
    bias: tuple[Path, str] | None = None
    """A head's bias: its file and key."""


MAPPED_DTYPES = frozenset({"F32", "F16", "BF16"})
"""Stored dtypes read as they are (anything else, FP8 with its scales included, is left to
transformers' loader)."""
HEAD_BLOCK_BYTES = 16 << 20
"""float32 bytes of one block of head rows (:class:`MappedHead`)."""


def _weight_files(source_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    import json

    from safetensors import safe_open

    index = source_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: source_dir / file for name, file in weight_map.items()}
    single = source_dir / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _mappable(model: Any, source_dir: Path) -> dict[str, _StoredTensor]:
    """The input embedding (a plain ``nn.Embedding``) and output head (a plain ``nn.Linear``)
    of the meta ``model`` whose weights the source stores as plain floats: module path -> where
    (a tied head reads the embedding's rows)."""
    from safetensors import safe_open

    files = _weight_files(source_dir)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    paths = {id(m): n for n, m in model.named_modules()}

    def stored(name: str) -> tuple[Path, str] | None:
        for key in (name, name.removeprefix(prefix)):
            if key in files:
                with safe_open(str(files[key]), framework="pt") as f:
                    if f.get_slice(key).get_dtype() in MAPPED_DTYPES:
                        return files[key], key
                return None
        return None

    found: dict[str, _StoredTensor] = {}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    plain_embedding = type(embedding) is nn.Embedding and id(embedding) in paths
    plain_head = type(head) is nn.Linear and id(head) in paths
    embedding_at = stored(f"{paths[id(embedding)]}.weight") if plain_embedding else None
    head_at = stored(f"{paths[id(head)]}.weight") if plain_head else None
    if bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False)):
        # a tied pair is stored once, under either name (SmolLM2 under the embedding's; a
        # checkpoint saved from the head's side under ``lm_head.weight``): both read that one
        embedding_at, head_at = embedding_at or head_at, head_at or embedding_at
    if plain_embedding and embedding_at is not None:
        found[paths[id(embedding)]] = _StoredTensor("embedding", *embedding_at)
    if plain_head and head_at is not None:
        path = paths[id(head)]
        bias = stored(f"{path}.bias") if head.bias is not None else None
        if (head.bias is None) == (bias is None):
            found[path] = _StoredTensor("head", *head_at, bias=bias)
    return found


class MappedEmbedding(nn.Module):
    """Stands in for a plain ``nn.Embedding``: the rows of the input's token ids, read from the
    memory-mapped file in their stored dtype, cast to ``dtype`` as transformers casts the
    weight (the dtype of the module it stands in for, as loaded)."""

    def __init__(self, stored: _StoredTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.stored, self.dtype = stored, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        unique, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        with safe_open(str(self.stored.file), framework="pt") as f:
            rows = f.get_slice(self.stored.key)
            gathered = torch.cat([rows[i : i + 1] for i in unique.tolist()])
        out = gathered.to(self.dtype)[inverse]
        return out.reshape(*input_ids.shape, out.shape[-1])


class MappedHead(nn.Module):
    """Stands in for a plain ``nn.Linear`` output head: the logits of a block of
    :data:`HEAD_BLOCK_BYTES` of vocabulary rows at a time, read from the memory-mapped file in
    their stored dtype and upcast to float32, as are the hidden states (float32 logits)."""

    def __init__(self, stored: _StoredTensor) -> None:
        super().__init__()
        self.stored = stored

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        h = hidden.float()
        with safe_open(str(self.stored.file), framework="pt") as f:
            vocab = int(f.get_slice(self.stored.key).get_shape()[0])
        out = torch.empty(*hidden.shape[:-1], vocab, dtype=torch.float32)
        step = max(1, HEAD_BLOCK_BYTES // (4 * hidden.shape[-1]))
        for start in range(0, vocab, step):
            # The file is mapped afresh for each block: the pages a block touched leave the
            # process's resident set with it (the kernel's page cache may keep them, reclaimably).
            with safe_open(str(self.stored.file), framework="pt") as f:
                block = f.get_slice(self.stored.key)[start : start + step]
            out[..., start : start + step] = h @ block.float().T
        if self.stored.bias is not None:
            with safe_open(str(self.stored.bias[0]), framework="pt") as f:
                out += f.get_tensor(self.stored.bias[1]).float()
        return out


def _replace_module(model: Any, path: str, stored: _StoredTensor) -> None:
    """Put the mapped stand-in where transformers' module (never loaded: on ``disk``) was."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    loaded = model.get_submodule(path).weight.dtype
    made = MappedEmbedding(stored, loaded) if stored.kind == "embedding" else MappedHead(stored)
    setattr(parent, name, made)
