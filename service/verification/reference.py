"""The inputs every check feeds and PyTorch's answers to them: what an export is held to.

:func:`fixed_input_ids` is the one batch the job's reference outputs are computed on
(:mod:`service.jobs.pipeline`, the safetensors check); :func:`prompt_ids` the prompt (or the
encoder input) a graph export is traced and run with; :func:`greedy_reference` PyTorch's greedy
decode of that prompt, which tract and onnxruntime replay.

torch is imported inside the functions: importing this module costs numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

SEQ_LEN = 8
SEED = 0


def fixed_input_ids(vocab_size: int, seq_len: int = SEQ_LEN, seed: int = SEED) -> torch.Tensor:
    """A deterministic ``(1, seq_len)`` batch of token ids, the same for every job."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, vocab_size), (1, seq_len), generator=gen)


def prompt_ids(count: int, vocab_size: int) -> list[int]:
    """A fixed, spread-out prompt that avoids the usual special-token ids at the vocab start."""
    low = min(8, vocab_size - 1)
    span = max(1, vocab_size - low)
    return [low + (i * 7919 + 13) % span for i in range(count)]


@dataclass(frozen=True)
class GreedyReference:
    """PyTorch's greedy decode: the token fed at each step and the logits it produced."""

    prompt: list[int]
    tokens: list[int]
    """Greedy tokens, one per step (the last one is produced, not fed)."""
    logits: list[np.ndarray]
    """Logits of the last position at each step: the prompt, then each fed token."""
    layer_names: list[str] = field(default_factory=list)
    """The decoder layers' module names (``model.layers.0``...), when recorded."""
    layers: np.ndarray | None = None
    """Last position of each layer's output at each step, ``[steps, layers, hidden]``."""
    hidden: np.ndarray | None = None
    """Each layer's output at every position fed (the prompt, then each fed token),
    ``[layers, positions, hidden]`` in float32 (exact for 16-bit models): what a layer-by-layer
    check feeds each block, when recorded (``record_hidden``)."""


def decoder_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of each layer of the model's layer stack: its longest ``ModuleList``."""
    from torch import nn

    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        return []
    name, stack = max(stacks, key=lambda item: len(item[1]))
    return [(f"{name}.{i}", layer) for i, layer in enumerate(stack)]


def greedy_reference(
    model: Any,
    prompt: Sequence[int],
    decode_steps: int,
    *,
    record_layers: bool = False,
    record_hidden: bool = False,
) -> GreedyReference:
    """Greedy decode with the KV cache in PyTorch (``model`` is a transformers causal LM).

    With ``record_layers`` each layer's output (last position) is kept too, through forward
    hooks: a few KiB per layer and step, what a failed check compares to say where it starts.
    With ``record_hidden`` every position of each layer's output is kept as well (layers x
    positions x hidden floats), what a layer-by-layer check feeds its blocks."""
    import torch

    tokens: list[int] = []
    logits: list[np.ndarray] = []
    layers = decoder_layers(model) if record_layers or record_hidden else []
    step_layers: list[np.ndarray | None] = [None] * len(layers)
    recorded: list[np.ndarray] = []
    full: list[list[np.ndarray]] = [[] for _ in layers]

    def keep(index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            rows = hidden.reshape(-1, hidden.shape[-1]).float().as_subclass(torch.Tensor)
            step_layers[index] = rows[-1].numpy().copy()
            if record_hidden:
                full[index].append(rows.numpy().copy())

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, (_, layer) in enumerate(layers)]
    ids = torch.tensor([list(prompt)], dtype=torch.int64)
    past = None
    try:
        with torch.no_grad():
            for _ in range(decode_steps + 1):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                last = out.logits[0, -1].float().as_subclass(torch.Tensor)
                logits.append(last.numpy().copy())
                tokens.append(int(torch.argmax(last)))
                past = out.past_key_values
                ids = torch.tensor([[tokens[-1]]], dtype=torch.int64)
                if layers and all(x is not None for x in step_layers):
                    recorded.append(np.stack([x for x in step_layers if x is not None]))
    finally:
        for handle in handles:
            handle.remove()
    complete = bool(layers) and len(recorded) == decode_steps + 1
    return GreedyReference(
        [int(t) for t in prompt], tokens, logits,
        layer_names=[n for n, _ in layers] if complete else [],
        layers=np.stack(recorded) if complete and record_layers else None,
        hidden=np.stack([np.concatenate(f) for f in full]) if complete and record_hidden else None,
    )  # fmt: skip
