"""GGUF for llama.cpp: ``{"format": "gguf", "type": "f32"|"f16"|"bf16"|"q8_0"|"q4_0"}``.

The file is laid out from metadata (``gguf_plan``), written tensor by tensor with bounded memory
and hashed on the way (``gguf_stream``), then read back and compared with the source weights;
an export beyond its type's error bound fails with :class:`VerificationFailed`. Unsupported
architectures are refused by :meth:`GGUFExporter.check` at submission (422).

Only pydantic and the service's own modules are imported here; ``gguf``, ``numpy`` and the
tokenizer stack load inside :meth:`GGUFExporter.export`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from service.errors import NoModelConfig
from service.exporters.base import Exporter, ExportInputs, ExportResult, ExportSpec, register
from service.exporters.gguf_plan import resolve_architecture
from service.stage import JobContext, Phase


class GGUFSpec(ExportSpec):
    format: Literal["gguf"] = "gguf"
    type: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = "f16"


class GGUFExporter(Exporter):
    format: ClassVar[str] = "gguf"
    spec_type: ClassVar[type[ExportSpec]] = GGUFSpec

    def check(self, spec: ExportSpec, config: dict[str, Any] | None) -> None:
        """Refuse architectures llama.cpp's GGUF layout is not written for here."""
        if config is not None:
            resolve_architecture(config)

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        from service.exporters.gguf_plan import add_hyperparameters, plan_tensors
        from service.exporters.gguf_stream import verify_gguf, write_gguf
        from service.exporters.gguf_vocab import add_vocab

        assert isinstance(spec, GGUFSpec)
        checkpoint = inputs.checkpoint
        config = checkpoint.config
        if config is None:
            raise NoModelConfig("GGUF export needs the checkpoint's config.json")
        self.check(spec, config)
        reader = checkpoint.reader
        plan = plan_tensors(config, reader.tensor_infos(), reader.aliases(), spec.type)
        tokenizer: dict[str, Any] = {}

        def metadata(writer: Any) -> None:
            add_hyperparameters(writer, plan, config, checkpoint.root.name)
            tokenizer.update(
                add_vocab(writer, checkpoint.root, plan.arch.vocab_order, int(config["vocab_size"]))
            )

        name = f"model-{spec.type}.gguf"
        path = out_dir / name
        ctx.set_phase(Phase.EXPORT, total=2 * plan.data_bytes, unit="bytes")
        digest = write_gguf(path, plan, reader, metadata, ctx)
        size = path.stat().st_size
        ctx.add_metric("bytes_written", size)
        report = verify_gguf(path, plan, reader, ctx)

        types: dict[str, int] = {}
        for t in plan.tensors:
            types[t.type_name] = types.get(t.type_name, 0) + 1
        summary = {
            "file": name,
            "type": spec.type,
            "architecture": plan.arch_name,
            "bytes": size,
            "tensors": len(plan.tensors),
            "tensor_types": types,
            "qk_permuted": plan.arch.permute_qk,
            "skipped": list(plan.skipped),
            "tokenizer": tokenizer,
            "verification": report.as_dict(),
        }
        return ExportResult(files=[name], summary=summary, digests={name: digest})


register(GGUFExporter())
