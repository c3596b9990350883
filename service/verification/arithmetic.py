"""ggml's arithmetic applied to transformers' forward: what a correct file's logits may differ by.

llama.cpp's CPU backend does not multiply a weight by float32 activations: for a weight of type
``T`` it first converts the activations to ``T``'s ``vec_dot_type`` (ggml-cpu's type traits):
f16 weights take f16 activations, bf16 take bf16, q8_0/q4_0/q4_1/q5_*/IQ4_NL take q8_0
(blocks of 32, an f16 scale ``amax/127`` and int8 codes) and the K-quants take q8_K (blocks of
256, a float32 scale). Its KV cache holds K and V in f16. Those roundings are the arithmetic
difference between llama.cpp on a file and transformers' float32 forward on the file's own
weights; everything else (accumulation order, its exp and rope) is float32 noise far below.

:class:`ActivationRounding` applies them to the second half of a batch (the first half runs
exact), so one forward gives the exact reference and its rounded twin: their distance is the
arithmetic's own effect on this model (``c_arith``), which the exact check's tolerance is a
multiple of (``service.exporters.gguf.exact``).
"""

from __future__ import annotations

from typing import Any, Self

import torch

Q8_0_TYPES = frozenset({"q8_0", "q8_1", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"})
"""ggml types whose matmul converts the activations to q8_0 (blocks of 32)."""
Q8_K_TYPES = frozenset(
    {"q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq3_s",
     "iq2_s", "iq1_s", "iq1_m"}
)  # fmt: skip
"""ggml types whose matmul converts the activations to q8_K (blocks of 256)."""


def vec_dot_kind(ggml_type: str) -> str | None:
    """The rounding ggml applies to the activations a weight of ``ggml_type`` multiplies."""
    name = ggml_type.lower()
    if name in ("f16", "bf16"):
        return name
    if name in Q8_0_TYPES:
        return "q8_0"
    if name in Q8_K_TYPES:
        return "q8_k"
    return None


def round_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` (float32, last dimension the one multiplied) as ggml converts it for ``kind``."""
    if kind == "f16":
        return x.half().float()
    if kind == "bf16":
        return x.bfloat16().float()
    block = 32 if kind == "q8_0" else 256
    n = x.shape[-1]
    if n % block:
        return x
    blocks = x.reshape(*x.shape[:-1], n // block, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    if kind == "q8_0":
        scale = scale.half().float()  # q8_0 stores its scale in f16
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / safe).clamp(-127, 127)
    return (codes * scale).reshape(x.shape)


class ActivationRounding:
    """Forward hooks rounding, for batch rows ``first_row`` on, the inputs of the linear
    modules in ``kinds`` (module path -> :func:`vec_dot_kind`'s answer) and the outputs of the
    key and value projections (f16, llama.cpp's KV cache); removed on exit."""

    def __init__(self, model: Any, kinds: dict[str, str], first_row: int) -> None:
        self.model, self.kinds, self.first_row = model, kinds, first_row
        self.handles: list[Any] = []

    def _rounded(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if not x.is_floating_point():  # an embedding's token ids: a lookup, nothing multiplied
            return x
        out = x.clone()
        out[self.first_row :] = round_activations(x[self.first_row :].float(), kind).to(x.dtype)
        return out

    def __enter__(self) -> Self:
        for name, module in self.model.named_modules():
            kind = self.kinds.get(name)
            if kind is not None:
                self.handles.append(module.register_forward_pre_hook(
                    lambda _m, args, kind=kind: (self._rounded(args[0], kind), *args[1:])
                ))  # fmt: skip
            if name.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
                self.handles.append(module.register_forward_hook(
                    lambda _m, _args, out: self._rounded(out, "f16")
                ))  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
