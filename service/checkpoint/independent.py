"""The checkpoint as transformers' own ``from_pretrained`` reads it: the job's independent reference.

Every check of an artifact compares it with a reference. Computed by the job's own reader and
offload store, that reference shares any misreading of the source with the artifact (raw FP8
codes read as weights pass every such check). So once per job the reference comes from an
implementation that is not ours: transformers' ``AutoModelForCausalLM.from_pretrained`` of the
checkpoint directory, which implements the quantization configs it knows (block-scaled FP8 is
dequantized by its ``Fp8Dequantize``, bit for bit what ``service.checkpoint.fp8`` does).

* **whole**: the model fits the job's memory budget in float32: loaded in its dtype, cast to
  float32, run on the inputs.
* **layer-by-layer**: it does not: the same ``from_pretrained`` with ``device_map="auto"``, the
  budget as ``max_memory`` and an ``offload_folder`` in the job's work directory, so
  accelerate's hooks load each layer's weights when it runs; computed in the model's dtype.

What it produces: the outputs on the fixed input ids (:func:`fixed_input_ids`, what the
parity checks compare), and the logits on the chunks of the fixed text (``service.logits``:
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

from service.errors import ReferenceUnavailable, VerificationFailed
from service.logits import chunk_tokens, scored

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
    """float32 torch tensor: the model's output on the fixed input ids."""
    chunks: np.ndarray | None = None
    """The fixed text's tokens ``(n_chunk, n_ctx)``, None for a model without a tokenizer."""
    logits_dir: Path | None = None
    """``chunk-<i>.npy``: float32 logits ``(n_ctx, vocab)`` of each chunk (rows outside
    ``service.logits.scored`` are zero)."""
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
) -> IndependentReference:
    """transformers' outputs for ``input_ids`` and, for a causal LM, its logits on ``text``,
    within the budget; ``model_class`` the transformers class the job built (the one
    config.json names), loaded by its own ``from_pretrained``; with ``adapter_dir``, the PEFT
    LoRA adapter there merged into it by PEFT."""
    import torch
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source_dir), local_files_only=True)
    causal = model_class.__name__.endswith("ForCausalLM")
    params = _parameter_count(source_dir)
    whole = params * 4 <= max_memory_bytes
    kwargs: dict[str, Any] = {"dtype": "auto", "local_files_only": True}
    offload = work / "reference-offload"
    if not whole:
        kwargs.update(device_map=layers_on_disk(model_class, config), offload_folder=str(offload))
    model: Any
    try:
        model = model_class.from_pretrained(str(source_dir), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ReferenceUnavailable(
            f"transformers' from_pretrained, the job's independent reference, cannot load the "
            f"source: {type(exc).__name__}: {exc}"
        ) from exc
    if adapter_dir is not None:
        model = _merged_with_peft(model, adapter_dir)
    if whole:
        # nn.Module's own cast: transformers' refuses a model it calls quantized (a config
        # naming a method over float weights is), though every weight here is a float tensor.
        model = torch.nn.Module.float(model)
    model.eval()
    chunks = text_chunks(source_dir, text) if causal else None
    logits_dir = work / "reference-logits"
    logits_dir.mkdir(parents=True, exist_ok=True)
    window = scored(FIXED_TEXT_CTX)
    try:
        with torch.inference_mode():
            outputs = _outputs(model, model_class, input_ids)
            if chunks is not None:
                _chunk_logits(model, chunks, logits_dir, window)
    finally:
        del model
        shutil.rmtree(offload, ignore_errors=True)
    return IndependentReference(
        implementation=f"transformers.{model_class.__name__}.from_pretrained",
        version=transformers.__version__,
        mode="whole" if whole else "layer-by-layer",
        outputs=outputs,
        chunks=chunks,
        logits_dir=logits_dir if chunks is not None else None,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        info={"compute_dtype": "float32" if whole else str(getattr(config, "dtype", "")).removeprefix("torch.")},
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


def _merged_with_peft(model: Any, adapter_dir: Path) -> Any:
    """``model`` with the LoRA adapter in ``adapter_dir`` merged by PEFT's own
    ``merge_and_unload``: the reference for a job that merges it while reading."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
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


def layers_on_disk(model_class: Any, config: Any) -> dict[str, str]:
    """A device map with every block of the model's layer stack on ``disk`` (accelerate loads
    each when it runs) and the rest (embeddings, final norm, head) in RAM: accelerate's own
    ``"auto"`` map puts a tied embedding on disk under one name and looks it up under the
    other (KeyError on SmolLM2 with transformers 5)."""
    from accelerate import init_empty_weights
    from torch import nn

    model: Any
    with init_empty_weights():
        model = model_class(config)
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        return {"": "disk"}
    path, stack = max(stacks, key=lambda item: len(item[1]))
    device_map = {f"{path}.{i}": "disk" for i in range(len(stack))}
    parts = path.split(".")
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        module = model.get_submodule(parent) if parent else model
        for name, _ in module.named_children():
            if name != parts[depth]:
                device_map[f"{parent}.{name}" if parent else name] = "cpu"
    return device_map
