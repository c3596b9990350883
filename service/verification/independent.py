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
* **module-by-module**: one layer in float32 (x 1.7) does not fit the budget either (a 70B
  layer is 3.2 GiB): the device map puts each module of a layer that holds weights (each
  projection, each norm) on ``disk`` apart, so accelerate loads one projection at a time, and
  a plain ``nn.Linear`` larger than :data:`LINEAR_BLOCK_BYTES` in float32 whose weight the
  source stores as plain floats is never loaded: :class:`MappedLinear` computes it a block of
  output rows at a time from the memory-mapped file. transformers' own attention, MLP, norms
  and residuals run as in the other modes; only where a weight comes from changes.

What it produces: the outputs on the fixed input ids (:func:`fixed_input_ids`, what the parity
checks compare), and the logits on the chunks of the fixed text (``service.verification.logits``:
KL, top-1 and perplexity ratio of each artifact). The manifest says which mode and version (and,
module by module, which projections were read from the file in blocks).

A reader beside the job's own (``service.checkpoint.open_checkpoint``), and its check: the job
compares what its offloaded model computes with this before any artifact is judged.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.errors import ReferenceUnavailable, VerificationFailed
from service.verification.logits import FIXED_TEXT, chunk_tokens, scored
from service.verification.mapped import (
    LINEAR_BLOCK_BYTES,
    StoredTensor,
    mappable,
    mappable_linears,
    replace_module,
)

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
    model_class: Any = None
    """The transformers class that read the source (the job's build: the named architecture,
    else the auto class of its config, as for InternLM3, which transformers 5 builds as Llama):
    a check that runs transformers again (the GGUF exact check) runs this one."""
    text: str = ""
    """The text ``chunks`` were cut from (the fixed text, or the request's ``verify_text``): a
    check that computes logits of its own (the GGUF exact check) computes them on this one."""

    def chunk_logits(self, prefix: str = "chunk") -> list[np.ndarray]:
        """Each chunk's logits, memory-mapped from the work directory (``prefix="twin"``: the
        rounded twin's, when the reference was computed with ``twin``)."""
        assert self.chunks is not None and self.logits_dir is not None
        return [np.load(self.logits_dir / f"{prefix}-{i}.npy", mmap_mode="r") for i in range(len(self.chunks))]

    def summary(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "version": self.version,
            "mode": self.mode,
            "fixed_text_positions": 0 if self.chunks is None else len(self.chunks) * (FIXED_TEXT_CTX // 2 - 1),
            "text": "fixed" if self.text in ("", FIXED_TEXT) else "request's verify_text (sha256 "
            f"{hashlib.sha256(self.text.encode()).hexdigest()[:16]})",
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
    force_mode: str | None = None,
    block_bytes: int | None = None,
    twin: dict[str, str] | None = None,
    chunks: np.ndarray | None = None,
) -> IndependentReference:
    """transformers' outputs for ``input_ids`` and, for a causal LM, its logits on ``text``,
    within the budget; ``model_class`` the transformers class the job built (the one
    config.json names), loaded by its own ``from_pretrained``; with ``adapter_dir``, the PEFT
    LoRA adapter there merged into it by PEFT (``merge_adapter``), or run beside it by PEFT's
    ``PeftModel`` (the reference of an adapter kept apart).

    ``with_outputs=False`` skips the forward on ``input_ids`` for a job whose checks read only
    the fixed text's logits (a GGUF's llama.cpp run, nothing compared with the job's own model):
    layer by layer, that pass reads every weight from disk again for an output no one reads
    (8 tokens: about a fifth of the reference's time on a 3.7 GB checkpoint).

    The mode is the budget's (:func:`reference_mode`) unless ``force_mode`` names one (a test
    comparing two modes); ``block_bytes`` is :class:`MappedLinear`'s block (None:
    :data:`LINEAR_BLOCK_BYTES`).

    ``twin`` (module path -> ggml's activation rounding, ``verification.arithmetic``) also
    computes the fixed text's logits with llama.cpp's roundings applied (``twin-<i>.npy``), in
    the same forward: the batch holds the chunks twice, the second copy rounded.

    ``chunks``: ``text`` already cut by the same tokenizer (a second reading of the same model's
    text, the GGUF exact check's), used as given: loading Gemma 3's 262k-token tokenizer again
    costs seconds for the same ids."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source_dir), local_files_only=True)
    causal = model_class.__name__.endswith("ForCausalLM")
    params, layer = _parameter_count(source_dir)
    mode = reference_mode(params, layer, max_memory_bytes) if force_mode is None else force_mode
    whole = mode == "whole"
    kwargs: dict[str, Any] = {"dtype": "auto", "local_files_only": True}
    offload = work / "reference-offload"
    mapped: dict[str, StoredTensor] = {}
    if not whole:
        device_map, mapped = layers_on_disk(
            model_class, config, None if adapter_dir is not None else source_dir,
            by_module=mode == "module-by-module", block_bytes=block_bytes,
        )  # fmt: skip
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
        replace_module(model, path, stored, block_bytes)
    model.eval()
    if chunks is None:
        chunks = text_chunks(source_dir, text) if causal else None
    logits_dir = work / "reference-logits"
    logits_dir.mkdir(parents=True, exist_ok=True)
    window = scored(FIXED_TEXT_CTX)
    try:
        with torch.inference_mode():
            outputs = _outputs(model, model_class, input_ids) if with_outputs else None
            if chunks is not None:
                _chunk_logits(model, chunks, logits_dir, window, twin)
    finally:
        del model
        shutil.rmtree(offload, ignore_errors=True)
    peft = "" if adapter_dir is None else " + peft." + (
        "merge_and_unload" if merge_adapter else "PeftModel"
    )
    return IndependentReference(
        text=text,
        model_class=model_class,
        implementation=f"transformers.{model_class.__name__}.from_pretrained{peft}",
        version=transformers.__version__,
        mode=mode,
        outputs=outputs,
        chunks=chunks,
        logits_dir=logits_dir if chunks is not None else None,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        info={
            "compute_dtype": "float32",
            **({"mapped_from_file": sorted(p for p, m in mapped.items() if m.kind != "linear")}
               if any(m.kind != "linear" for m in mapped.values()) else {}),
            **({"projections_in_row_blocks": len([m for m in mapped.values() if m.kind == "linear"])}
               if mode == "module-by-module" else {}),
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


def _chunk_logits(
    model: Any, chunks: np.ndarray, logits_dir: Path, window: slice,
    twin: dict[str, str] | None = None,
) -> None:
    """A causal LM's logits on every chunk of the fixed text (``chunk-<i>.npy``), from one
    forward over the chunks as a batch: layer by layer, every forward reads every weight from
    disk again, so one pass instead of one per chunk. (The fixed input is shorter: batched, its
    padding would cost more compute than the pass it saves.) With ``twin``, the batch holds the
    chunks twice and the second copy runs with ggml's roundings (``twin-<i>.npy``)."""
    import torch

    from service.verification.arithmetic import ActivationRounding

    n = len(chunks)
    ids = torch.from_numpy(chunks.astype(np.int64))
    if twin is None:
        logits = model(input_ids=ids, use_cache=False).logits
    else:
        with ActivationRounding(model, twin, first_row=n):
            logits = model(input_ids=torch.cat([ids, ids]), use_cache=False).logits
        for i in range(n):
            _save_chunk(logits[n + i].float().numpy(), logits_dir / f"twin-{i}.npy", window)
    for i in range(n):
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


def _parameter_count(source_dir: Path) -> tuple[int, int]:
    """Elements of every stored tensor, and of the largest decoder layer (``.layers.<i>.``), from
    the safetensors headers (0, 0 when unknown: the model is then loaded whole and the budget
    judged by the job's own measures)."""
    import re

    from service.checkpoint.consistency import safetensors_tensors

    tensors = safetensors_tensors(source_dir) or {}
    total = 0
    layers: dict[str, int] = {}
    for name, (_, shape) in tensors.items():
        n = 1
        for d in shape:
            n *= d
        total += n
        if (found := re.search(r"\.layers\.(\d+)\.", name)) is not None:
            layers[found.group(1)] = layers.get(found.group(1), 0) + n
    return total, max(layers.values(), default=0)


LAYER_WEIGHT_FACTOR = 1.7
"""What a layer's float32 weights cost while accelerate loads them and the layer runs (the
plan's ``REFERENCE_WEIGHT_FACTOR``): a layer above the budget over this goes module by module."""


def reference_mode(params: int, layer: int, max_memory_bytes: int) -> str:
    """``whole`` when every float32 weight fits the budget, ``layer-by-layer`` when one layer
    does (x :data:`LAYER_WEIGHT_FACTOR`), else ``module-by-module``."""
    if params * 4 <= max_memory_bytes:
        return "whole"
    if layer * 4 * LAYER_WEIGHT_FACTOR <= max_memory_bytes:
        return "layer-by-layer"
    return "module-by-module"


def layers_on_disk(
    model_class: Any, config: Any, source_dir: Path | None = None, by_module: bool = False,
    block_bytes: int | None = None,
) -> tuple[dict[str, str], dict[str, StoredTensor]]:
    """A device map with every block of the model's layer stack on ``disk`` (accelerate loads
    each when it runs) and the rest (final norm, small buffers) in RAM, and the vocabulary-sized
    modules read from ``source_dir``'s files instead (:func:`_mappable`: on ``disk`` too, never
    loaded, replaced after loading; None: none, they stay in RAM). accelerate's own ``"auto"``
    map puts a tied embedding on disk under one name and looks it up under the other (KeyError
    on SmolLM2 with transformers 5).

    ``by_module``: each module of a layer that holds weights is an entry of its own
    (:func:`_weight_modules`), and the plain linear projections larger than ``block_bytes``
    in float32 are read from ``source_dir``'s files in row blocks (:class:`MappedLinear`)."""
    from accelerate import init_empty_weights

    model: Any
    with init_empty_weights():
        model = model_class(config)
    mapped = mappable(model, source_dir) if source_dir is not None else {}
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        return {"": "disk"}, {}
    path, stack = max(stacks, key=lambda item: len(item[1]))
    device_map = {f"{path}.{i}": "disk" for i in range(len(stack))}
    if by_module:
        device_map = {
            f"{path}.{i}{'.' if name else ''}{name}": "disk"
            for i, layer in enumerate(stack)
            for name in _weight_modules(layer)
        }
        if source_dir is not None:
            limit = LINEAR_BLOCK_BYTES if block_bytes is None else block_bytes
            mapped.update(mappable_linears(model, f"{path}.", source_dir, limit))
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


def _weight_modules(layer: nn.Module) -> list[str]:
    """The modules of ``layer`` (names relative to it, ``""`` the layer itself) that hold
    weights or buffers of their own, outermost first: each an entry of a module-by-module
    device map. A module whose ancestor holds some of its own is loaded with that ancestor."""
    found: list[str] = []
    for name, module in layer.named_modules():
        if any(name == f or name.startswith(f"{f}.") or f == "" for f in found):
            continue
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if own:
            found.append(name)
    return found
