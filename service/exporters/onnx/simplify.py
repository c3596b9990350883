"""The captured graph's clean-up before it is written: onnxscript's ``optimize_ir`` with the
rewrite rules that change a captured decoder, not all of them.

``onnxscript.optimizer.optimize_ir`` folds constants, then tries every one of its default rewrite
rules (about thirty-four, conv and batch-norm fusions among them) on every node, twice. On a
stamped decoder that matching is nearly all of the write phase: SmolLM2-135M (30 layers, 5472
nodes) took 47.6 s in ``optimize_ir`` and about 5 s here (one process, 2 cores shared,
2026-11-28); the file written is the same but for two ``Reshape`` nodes in the shared preamble
(2278 nodes against 2276), its data byte for byte. The rules that changed it were the redundant
``Slice`` collapse (four per layer: 125 of the 135 nodes the rewriter removed), the arithmetic
no-ops and, once each in the preamble, ``Unsqueeze``, ``Transpose`` and ``Reshape`` pairs:
:func:`rules` are those and their cheap relatives; the rest (convolutions, batch norm,
``Gemm``, clips, scatter) have nothing to match in a transformer decoder. onnxruntime then
applies its own graph optimizations when it loads the file, as for any package.

The passes are otherwise ``optimize_ir``'s, in its order (onnxscript 0.7): inline, then up to two
rounds of constant folding, rewriting and removal of what became unused, stopping early when a
round changes nothing; then lifting constants to initializers, deduplicating small initializers,
common subexpression elimination and name fixing. ``should_fold`` keeps each weight one lazy
tensor (see ``exporter._save``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

ROUNDS = 2
"""Rounds of folding and rewriting, as ``optimize_ir``'s ``num_iterations``: a collapsed
``Slice`` leaves an ``Identity`` that the second round folds away."""


def rules() -> Any:
    """The rewrite rules that change a captured decoder (see the module docstring)."""
    from onnxscript.rewriter import RewriteRuleSet
    from onnxscript.rewriter.rules import common as r

    return RewriteRuleSet([
        r.collapse_slice_rule, r.collapse_slice2_rule,
        *r.mul_by_1_rule.commute(), *r.add_0_rule.commute(), r.sub_0_rule, r.div_by_1_rule,
        r.dropout_zero_rule, r.dropout_inference_rule,
        r.cast_cast_rule, r.no_op_cast_rule, r.no_op_expand_rule, r.no_op_transpose_rule,
        r.transpose_transpose_rule, r.reshape_reshape_rule, r.unsqueeze_unsqueeze_rule,
    ])  # fmt: skip


def simplify(model: ir.Model, should_fold: Callable[[ir.Node], bool | None]) -> None:
    """Fold, rewrite with :func:`rules` and clean ``model`` in place (``optimize_ir``'s passes)."""
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript.optimizer import fold_constants_ir
    from onnxscript.rewriter import RewritePass

    common.InlinePass()(model)
    rewrite = RewritePass(rules())
    cleanup = (
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),  # type: ignore[no-untyped-call]
        common.RemoveUnusedOpsetsPass(),
    )
    for _ in range(ROUNDS):
        folded = fold_constants_ir(model, onnx_shape_inference=True, should_fold=should_fold)
        modified = folded.modified
        modified |= rewrite(model).modified
        for step in cleanup:
            modified |= step(model).modified
        if not modified:
            break
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)
