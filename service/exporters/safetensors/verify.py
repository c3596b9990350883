"""A safetensors export checked against its source by running both, with bounded memory.

Both sides run the same way: built on meta, dispatched to an offload store within a RAM budget,
forward streamed module by module, on one fixed input, computing in float32. The figure kept is
the largest absolute difference of the outputs (logits, or the last hidden state), and that
difference relative to the largest reference magnitude; beyond the export dtype's tolerance
(:data:`service.verification.parity.TOLERANCES`, ``torch``) the job fails with
:class:`VerificationFailed`.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch

from service.checkpoint.base import Checkpoint
from service.config import Settings
from service.errors import VerificationFailed
from service.offload.build import build_on_meta
from service.offload.dispatch import dispatch_model
from service.offload.store import OffloadStore
from service.offload.streaming import streamed_forward
from service.stage import JobContext, SideContext
from service.tensors import dtype_name
from service.verification.parity import relative_agreement, tolerance_for
from service.verification.reference import SEED, fixed_input_ids

_verify_runs = itertools.count()


def _inputs(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def streamed_outputs(
    checkpoint: Checkpoint,
    input_ids: torch.Tensor,
    settings: Settings,
    ctx: JobContext,
    store_root: Path,
    *,
    max_memory: int | str | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Outputs of ``checkpoint``'s model on ``input_ids``, computed in float32 with weights
    streamed from a temporary store at ``store_root`` (deleted afterwards, whatever happens).

    Returns the output tensor and the run's figures (reloads, bytes read, peak paged bytes).
    """
    built = build_on_meta(checkpoint, settings, dtype=torch.float32)
    store = OffloadStore(
        store_root,
        quota_bytes=settings.offload_quota_bytes,
        allowed_roots=[checkpoint.root if checkpoint.root.is_dir() else checkpoint.root.parent],
    )
    try:
        result = dispatch_model(
            built,
            checkpoint.reader,
            store,
            SideContext(ctx, ctx.work_dir),
            max_memory=max_memory or settings.offload_memory,
        )
        ctx.check_abort()
        started = time.perf_counter()
        output, stats = streamed_forward(
            result.model, _inputs(input_ids), check_abort=ctx.check_abort
        )
        figures = {
            "architecture": built.architecture,
            "forward_seconds": round(time.perf_counter() - started, 4),
            "reloads": store.reloads,
            "bytes_read": store.bytes_read,
            "peak_paged_bytes": stats.peak_resident_bytes,
            "placed": result.placed,
        }
        return output.float(), figures
    finally:
        store.destroy()


def reference_outputs(
    checkpoint: Checkpoint,
    input_ids: torch.Tensor,
    settings: Settings,
    ctx: JobContext,
    *,
    max_memory: int | str | None = None,
) -> torch.Tensor:
    """The source model's outputs (float32) on ``input_ids``: what every export is held to."""
    output, _ = streamed_outputs(
        checkpoint, input_ids, settings, ctx, _scratch(ctx, "reference"), max_memory=max_memory
    )
    return output


def verify_safetensors_export(
    source: Checkpoint,
    export_dir: Path,
    dtype: torch.dtype | str,
    ctx: JobContext,
    *,
    reference: torch.Tensor | None = None,
    max_memory: int | str | None = None,
) -> dict[str, Any]:
    """Check a safetensors export against its source; the dict goes into the manifest.

    Both models are streamed (never fully in RAM). Pass ``reference`` (from
    :func:`reference_outputs`) to reuse the source's outputs across several exports. Raises
    :class:`VerificationFailed` beyond ``tolerance_for("torch", dtype)``.
    """
    from service.checkpoint import open_checkpoint

    settings = ctx.settings
    tolerance = tolerance_for("torch", dtype)
    vocab = int((source.config or {}).get("vocab_size", 0) or 0)
    input_ids = fixed_input_ids(vocab)
    started = time.perf_counter()
    if reference is None:
        reference = reference_outputs(source, input_ids, settings, ctx, max_memory=max_memory)
    with open_checkpoint(export_dir) as exported:
        if exported.config is None:
            exported.config = source.config
        candidate, figures = streamed_outputs(
            exported,
            input_ids,
            settings,
            ctx,
            _scratch(ctx, "export"),
            max_memory=max_memory,
        )
    result = relative_agreement(reference, candidate, tolerance.rtol)
    summary = {
        **result,
        "input_shape": list(input_ids.shape),
        "seed": SEED,
        "dtype": dtype_name(dtype),
        "seconds": round(time.perf_counter() - started, 3),
        "export_run": figures,
    }
    if not result["passed"]:
        raise VerificationFailed(
            f"export differs from its source beyond tolerance: "
            f"{result.get('reason') or _describe(result)}"
        )
    return summary


def _describe(result: dict[str, Any]) -> str:
    return (
        f"max abs error {result['max_abs_error']:.3g}, relative {result['max_rel_error']:.3g} "
        f"> {result['tolerance']:.3g}" + ("" if result["finite"] else " (non-finite outputs)")
    )


def _scratch(ctx: JobContext, label: str) -> Path:
    return ctx.work_dir / "verify" / f"{label}-{next(_verify_runs)}"
