"""What a transformers causal LM needs before torch's dynamo exporter can capture it on meta.

Why: the ONNX export traces the model's own ``forward`` (``service.exporters.onnx.exporter``):
one mechanism for every family, with no graph written per family. Three things in transformers
5 stand in its way, each set right on the copy that is traced (never on the job's model):

* **attention**: ``set_attn_implementation("sdpa")`` gives onnxruntime one fused attention node;
  a family sdpa cannot express refuses it with a ``ValueError`` (Gemma 2's soft-capped scores),
  and is traced with ``"eager"``, the reference's own attention;
* **MoE experts**: the default experts implementation (``grouped_mm``) sorts tokens by expert
  with ``torch.histc``, which the ONNX translation refuses (integer input on meta), and the
  eager one loops over the experts a batch hit (data-dependent control flow).
  ``set_experts_implementation("batched_mm")`` gathers each token's ``top_k`` experts' matrices
  and multiplies them (``integrations/moe.py``, ``batched_mm_experts_forward``): no data-
  dependent shape, so the graph takes any batch and length. Its cost is a copy of ``top_k``
  expert matrices per token at run time, which is what the ONNX graph then does too;
* **Falcon's fused QKV split** (``FalconAttention._split_heads``) picks the key and value heads
  with list indices (``qkv[..., [-2]]``): torch.export lifts such a list as a tensor constant,
  made on meta here and so without data in the graph. :func:`_falcon_split_heads` is the same
  split with slices (``qkv[..., -2:-1]``: same shape, same values);
* **Falcon's linear layers** (``FalconLinear``: ``input @ self.weight.T + bias``, apart so as
  to round to bfloat16 between the two as its training did): on the job's offloaded weights
  (torch-to-nnef's tensor subclass) ``.T`` fails inside PyTorch (an internal assert of its
  ``__torch_function__`` dispatch, torch 2.13), so the reference forward could not run.
  :func:`plain_linears` makes them ``nn.Linear`` (the NNEF export does the same): in float32,
  or float16 where the bias is added to the rounded product either way, the numbers are the
  same, and the graph is the same ``MatMul(x, Transpose(W))``.

What is used (checked on transformers 5.23; ``tests/unit/shims/test_transformers_capture.py``
names each assumption): ``PreTrainedModel.set_attn_implementation`` raising ``ValueError`` for an
implementation the family lacks; ``PreTrainedModel.get_experts_implementation()`` (``{"": name}``; ``eager`` for a model
without experts, ``grouped_mm`` for a MoE on CPU) and ``set_experts_implementation``;
``FalconAttention._split_heads(fused_qkv)`` and its attributes ``new_decoder_architecture``,
``multi_query``, ``num_heads``, ``num_kv_heads``, ``head_dim``; ``FalconLinear`` an
``nn.Linear`` subclass with no state of its own.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

CHECKED_ON = "5.23"
"""The transformers release this shim was checked on (``pyproject.toml`` caps below the next)."""


def prepare_for_capture(module: nn.Module) -> None:
    """Set ``module`` (a copy about to be traced) up for the dynamo exporter, in place."""
    set_attn = getattr(module, "set_attn_implementation", None)
    if callable(set_attn):
        try:  # one fused attention node for onnxruntime, no eager mask arithmetic
            set_attn("sdpa")
        except ValueError:  # a family sdpa cannot express (Gemma 2's soft-capped scores)
            set_attn("eager")
    get_experts = getattr(module, "get_experts_implementation", None)
    if callable(get_experts) and get_experts().get("") not in (None, "eager", "batched_mm"):
        module.set_experts_implementation("batched_mm")  # type: ignore[operator]
    for child in module.modules():
        if type(child).__name__ == "FalconAttention" and hasattr(child, "_split_heads"):
            setattr(child, "_split_heads", types.MethodType(_falcon_split_heads, child))  # noqa: B010
    plain_linears(module)


PLAIN_LINEARS = frozenset({"FalconLinear"})
"""``nn.Linear`` subclasses whose forward is ``nn.Linear``'s in float32 and float16."""


def plain_linears(module: nn.Module) -> None:
    """Make every :data:`PLAIN_LINEARS` layer of ``module`` an ``nn.Linear``, in place."""
    from torch import nn

    for child in module.modules():
        if type(child).__name__ in PLAIN_LINEARS and isinstance(child, nn.Linear):
            child.__class__ = nn.Linear


def _falcon_split_heads(
    self: Any, fused_qkv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``FalconAttention._split_heads`` with slices where it indexes with lists."""
    import torch

    if self.new_decoder_architecture:
        batch, seq_len, _ = fused_qkv.shape
        groups = self.num_heads // self.num_kv_heads + 2
        qkv = fused_qkv.view(batch, seq_len, -1, groups, self.head_dim)
        query = qkv[:, :, :, :-2]
        key = torch.broadcast_to(qkv[:, :, :, -2:-1], query.shape)
        value = torch.broadcast_to(qkv[:, :, :, -1:], query.shape)
        return query.flatten(2, 3), key.flatten(2, 3), value.flatten(2, 3)
    batch, seq_len, _ = fused_qkv.shape
    if not self.multi_query:
        fused = fused_qkv.view(batch, seq_len, self.num_heads, 3, self.head_dim)
        return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
    fused = fused_qkv.view(batch, seq_len, self.num_heads + 2, self.head_dim)
    return fused[..., :-2, :], fused[..., -2:-1, :], fused[..., -1:, :]
