"""The job's PEFT LoRA adapter written as a GGUF LoRA (``{"format": "gguf", "lora": true}`` with
``"merge": false``), for llama.cpp's ``--lora`` on the base GGUF written beside it.

What is written is what llama.cpp's ``convert_lora_to_gguf.py --base <source>`` writes
(``service.shims.llama_cpp_convert.plan_lora_conversion``): ``<tensor>.lora_a`` ``(r, in)`` and
``<tensor>.lora_b`` ``(out, r)`` under the base GGUF's tensor names, transformed as the base's
weight is (the q/k row permutation acts on ``B``), and ``adapter.lora.alpha``. llama.cpp scales
every pair by ``alpha / r`` (``r`` read from the pair), which is PEFT's scale for a plain LoRA and
per-module ranks (``rank_pattern``) but not for rsLoRA (``alpha / sqrt(r)``) or an
``alpha_pattern``: upstream's script writes those with the wrong scale. Here the ratio of PEFT's
scale to llama.cpp's is folded into ``B`` (float32, before rounding), so llama.cpp computes what
PEFT computes for every adapter this service accepts.

The file is small (the adapter's own size), written and read back as it is written, like the
base GGUF (``writer``), then checked by llama.cpp itself: ``llama-perplexity --lora`` on the base GGUF
against PEFT's unmerged ``PeftModel`` on the fixed text (KL, top-1, perplexity ratio), judged by
the margin-aware default of the quality report (``llama_check.check_logits``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import UnsupportedAdapter, UnsupportedExport
from service.exporters.gguf.layout import FILE_TYPES, GGUFPlan, OutType, TensorPlan
from service.exporters.gguf.provenance import add_provenance

if TYPE_CHECKING:
    import torch

    from service.checkpoint.lora import LoraAdapter
    from service.exporters.base import ExportInputs
    from service.exporters.gguf.spec import GGUFSpec
    from service.stage import JobContext

LORA_PREFIX = "lora-"

LORA_TYPES: dict[str, OutType] = {"f32": "f32", "bf16": "bf16", "q8_0": "q8_0"}
"""The LoRA file's type by the base's: the same where llama.cpp's LoRA converter writes it,
f16 otherwise (q4_0 and llama-quantize's types are not LoRA converter types)."""


def lora_type(base_type: str) -> OutType:
    return LORA_TYPES.get(base_type, "f16")


def lora_file_name(spec: GGUFSpec) -> str:
    return f"{LORA_PREFIX}{lora_type(spec.type)}.gguf"


def llama_cpp_factors(
    adapter: LoraAdapter,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, dict[str, float]]:
    """(base weight name -> ``(A, B)`` as llama.cpp must hold them, ``adapter.lora.alpha``,
    module -> the factor folded into its ``B``): llama.cpp scales by ``alpha / r`` (by 1 when
    alpha is 0), PEFT by :meth:`AdapterPlan.scale`; ``B`` carries the ratio."""
    if adapter.fan_in_fan_out:
        raise UnsupportedAdapter(
            "a fan_in_fan_out adapter (Conv1D layers, GPT-2) is not written as a GGUF LoRA: "
            'llama.cpp\'s converter cannot transpose its factors; merge it ("merge": true)'
        )
    alpha = float(adapter.plan.config["lora_alpha"])
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    folded: dict[str, float] = {}
    for name, f in adapter.factors.items():
        rank = int(f.a.shape[0])
        theirs = alpha / rank if alpha else 1.0
        ratio = f.scale / theirs
        b = f.b if ratio == 1.0 else f.b * ratio
        if ratio != 1.0:
            folded[f.module] = ratio
        factors[name] = (f.a.contiguous(), b.contiguous())
    return factors, alpha, folded


def plan_lora(
    root: Path,
    config: dict[str, Any],
    adapter: LoraAdapter,
    out_type: OutType,
    bin_dir: Path | None = None,
    metadata: bool = True,
) -> tuple[GGUFPlan, dict[str, float]]:
    """The LoRA file's plan (every tensor computed from the adapter's factors) and the scale
    ratios folded into ``B``."""
    import gguf

    from service.shims.llama_cpp_convert import plan_lora_conversion

    factors, alpha, folded = llama_cpp_factors(adapter)
    try:
        conversion = plan_lora_conversion(
            root, config, factors, alpha, out_type, adapter_root=adapter.root, bin_dir=bin_dir,
            metadata=metadata,
        )  # fmt: skip
    except UnsupportedExport as exc:
        raise UnsupportedAdapter(f"the adapter cannot be written as a GGUF LoRA: {exc}") from exc
    tensors = tuple(
        TensorPlan(t.name, None, t.shape, t.ggml_type, t.nbytes, compute=t.compute)
        for t in conversion.tensors
    )
    plan = GGUFPlan(
        arch_name=conversion.arch_name,
        hf_architecture=conversion.hf_architecture,
        converter_class=f"convert_lora_to_gguf {conversion.model_class}",
        out_type=out_type,
        file_type=int(gguf.LlamaFileType[FILE_TYPES[out_type]]),
        tensors=tensors,
        metadata=tuple(conversion.metadata),
    )
    return plan, folded


def export_lora(
    spec: GGUFSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
) -> tuple[str, str, dict[str, Any]]:
    """Write the job's adapter as ``lora-<type>.gguf`` in ``out_dir``, each row block read back
    as it is written (``writer.write_gguf``'s check), then the file's layout checked; (file
    name, sha256, the manifest's ``lora`` section)."""
    from service.checkpoint.lora import open_adapter
    from service.exporters.gguf.layout import add_metadata
    from service.exporters.gguf.verify import VerifyReport, verify_gguf
    from service.exporters.gguf.writer import write_gguf

    checkpoint = inputs.checkpoint
    root = checkpoint.unmerged_adapter
    if root is None or checkpoint.config is None:
        raise UnsupportedAdapter(
            '"lora": true writes the job\'s adapter, kept apart ("merge": false): the job has none'
        )
    adapter = open_adapter(root)
    out_type = lora_type(spec.type)
    bin_dir = ctx.settings.llama_cpp_dir
    plan, folded = plan_lora(checkpoint.root, checkpoint.config, adapter, out_type, bin_dir)
    name = lora_file_name(spec)

    def metadata(writer: Any) -> None:
        add_metadata(writer, plan)
        add_provenance(writer, spec, ctx.details.get("source", {}).get("adapter", {}))

    checked = VerifyReport()
    digest = write_gguf(out_dir / name, plan, checkpoint.reader, metadata, ctx, check=checked)
    verify_gguf(out_dir / name, plan, checkpoint.reader, ctx, read_back=False)
    report = checked
    return name, digest, {
        "file": name,
        "type": out_type,
        "converter": plan.converter_class,
        "bytes": (out_dir / name).stat().st_size,
        "tensors": len(plan.tensors),
        "modules": len(adapter.factors),
        "lora_alpha": plan.value("adapter.lora.alpha"),
        "scale_folded_into_b": folded,
        "verification": report.as_dict(),
    }


def verify_lora(
    spec: GGUFSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
) -> dict[str, Any]:
    """llama.cpp runs the base GGUF with ``--lora`` on the fixed text against PEFT's own run
    of the base with the adapter (``PeftModel``, unmerged, transformers' ``from_pretrained``);
    VerificationFailed by the margin-aware default of ``llama_check.check_logits``."""
    import gc

    from service.exporters.gguf.llama_check import check_logits
    from service.memory.libc import malloc_trim
    from service.units import parse_size
    from service.verification.independent import independent_reference
    from service.verification.logits import FIXED_TEXT
    from service.verification.reference import fixed_input_ids

    checkpoint = inputs.checkpoint
    assert checkpoint.unmerged_adapter is not None
    model_class: Any = type(inputs.model) if inputs.model is not None else None
    if model_class is None:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM
    vocab = int((checkpoint.config or {}).get("vocab_size", 0) or 0)
    work = ctx.work_dir / f"gguf-lora-{out_dir.name}"
    work.mkdir(parents=True, exist_ok=True)
    ctx.check_abort()
    reference = independent_reference(
        checkpoint.root, model_class, fixed_input_ids(vocab), inputs.verify_text or FIXED_TEXT,
        parse_size(inputs.max_memory or ctx.settings.offload_memory), work / "reference",
        adapter_dir=checkpoint.unmerged_adapter, merge_adapter=False, with_outputs=False,
    )  # fmt: skip
    gc.collect()
    malloc_trim()
    if reference.chunks is None:
        return {"skipped": "no tokenizer: the fixed text cannot be tokenized"}
    from service.exporters.gguf.mmproj import MMPROJ_PREFIX

    base = sorted(
        p for p in out_dir.glob("*.gguf") if not p.name.startswith((MMPROJ_PREFIX, LORA_PREFIX))
    )
    lora = out_dir / lora_file_name(spec)
    report = check_logits(
        base[0], spec.type, reference, work, ctx.check_abort, ctx.settings.llama_cpp_dir,
        lora=lora,
    )  # fmt: skip
    return {**report, "lora": lora.name}
