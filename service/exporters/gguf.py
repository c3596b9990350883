"""GGUF for llama.cpp: ``{"format": "gguf", "type": "f16"}`` (any case).

f32, f16, bf16, q8_0 and q4_0 are written directly: the file is laid out from metadata
(``gguf_plan``), written tensor by tensor with bounded memory and hashed on the way
(``gguf_stream``), then read back and compared with the source weights; an export beyond its
type's error bound fails with :class:`VerificationFailed`. The K-quants and IQ4 types
(``"Q4_K_M"``...) are llama-quantize's, with its per-tensor mixtures: the same streamed f16 file
goes to the job's work directory, is verified the same way, then quantized by llama.cpp's own tool
in a child process (``gguf_quantize``), optionally with an importance matrix computed by
llama-imatrix from ``"imatrix": {"calibration": "<text>"}``. Unsupported architectures are
refused by :meth:`GGUFExporter.check` at submission (422).

Only pydantic and the service's own modules are imported here; ``gguf``, ``numpy`` and the
tokenizer stack load inside :meth:`GGUFExporter.export`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.errors import NoModelConfig
from service.exporters.base import Exporter, ExportInputs, ExportResult, ExportSpec, register
from service.exporters.gguf_plan import OutType, resolve_architecture
from service.exporters.gguf_quantize import QUANTIZER_TYPES
from service.stage import JobContext, Phase

GGUFType = OutType | Literal[
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ4_NL", "IQ4_XS",
]  # fmt: skip
"""Types written directly (lower case, as before) and llama-quantize's (its own spelling)."""


class GGUFImatrix(BaseModel):
    """An importance matrix for llama-quantize, computed by llama-imatrix in the job."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    calibration: str = Field(min_length=1, max_length=4 * 1024**2)
    """Text run through the f16 model; a few thousand tokens of the model's kind of text."""


class GGUFSpec(ExportSpec):
    format: Literal["gguf"] = "gguf"
    type: GGUFType = "f16"
    imatrix: GGUFImatrix | None = None
    verify: bool = Field(
        default=True,
        description="For llama-quantize types, run llama.cpp on the file: tokenize a probe set "
        "(must equal the checkpoint's tokenizer) and compare perplexity with the f16's",
    )

    @field_validator("type", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        """``"q4_k_m"``, ``"Q4_K_M"`` and ``"F16"`` all name a type: normalise the spelling."""
        if not isinstance(value, str):
            return value
        low = value.lower()
        return QUANTIZER_TYPES.get(low, low)

    @model_validator(mode="after")
    def _imatrix_needs_quantizer(self) -> GGUFSpec:
        if self.imatrix is not None and not self.quantized:
            raise ValueError(
                f"an importance matrix only applies to llama-quantize types, not {self.type}"
            )
        return self

    @property
    def quantized(self) -> bool:
        """True for the types llama-quantize makes from an f16 file."""
        return self.type.lower() in QUANTIZER_TYPES


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
        from gguf import GGMLQuantizationType

        from service.exporters.gguf_directory import read_directory
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
        written = cast(OutType, "f16" if spec.quantized else spec.type)
        plan = plan_tensors(config, reader.tensor_infos(), reader.aliases(), written)
        tokenizer: dict[str, Any] = {}

        def metadata(writer: Any) -> None:
            add_hyperparameters(writer, plan, config, checkpoint.root.name)
            tokenizer.update(
                add_vocab(writer, checkpoint.root, plan.arch.vocab_order, int(config["vocab_size"]))
            )

        name = f"model-{spec.type}.gguf"
        path = out_dir / name
        # A quantized export writes f16 to the work dir first; llama-quantize's pass counts as
        # one more pass over the weights in the progress.
        passes = 3 if spec.quantized else 2
        ctx.set_phase(Phase.EXPORT, total=passes * plan.data_bytes, unit="bytes")
        stage = ctx.work_dir / "gguf" if spec.quantized else out_dir
        stage.mkdir(parents=True, exist_ok=True)
        written_path = stage / f"model-{written}.gguf"
        digest = write_gguf(written_path, plan, reader, metadata, ctx)
        report = verify_gguf(written_path, plan, reader, ctx)
        extra: dict[str, Any] = {}
        check = spec.verify and tokenizer.get("model", "none") != "none"
        if spec.quantized:
            digest, extra = self._quantize(
                spec, written_path, path, plan.data_bytes, ctx, check, checkpoint.root
            )
        size = path.stat().st_size
        ctx.add_metric("bytes_written", size)

        types: dict[str, int] = {}
        if spec.quantized:
            names = [GGMLQuantizationType(t.ggml_type).name for t in read_directory(path).tensors]
        else:
            names = [t.type_name for t in plan.tensors]
        for type_name in names:
            types[type_name] = types.get(type_name, 0) + 1
        summary = {
            "file": name,
            "type": spec.type,
            "architecture": plan.arch_name,
            "bytes": size,
            "tensors": sum(types.values()),
            "tensor_types": types,
            **extra,
            "qk_permuted": plan.arch.permute_qk,
            "skipped": list(plan.skipped),
            "tokenizer": tokenizer,
            "verification": report.as_dict(),
        }
        return ExportResult(files=[name], summary=summary, digests={name: digest})

    @staticmethod
    def _llama_tokenize(path: Path, root: Path, ctx: JobContext) -> dict[str, Any]:
        from service.exporters.gguf_llama_check import check_tokenizer

        work = ctx.work_dir / "gguf-check"
        work.mkdir(parents=True, exist_ok=True)
        return check_tokenizer(path, root, work, ctx.check_abort, ctx.settings.llama_cpp_dir)

    def _quantize(
        self,
        spec: GGUFSpec,
        f16: Path,
        dest: Path,
        units: int,
        ctx: JobContext,
        check: bool,
        root: Path,
    ) -> tuple[str, dict[str, Any]]:
        """llama-quantize (after llama-imatrix when asked) from the verified f16 file; with
        ``check``, llama.cpp's tokenization and perplexity of both files (no file is kept when
        a check fails)."""
        from service.exporters.gguf_llama_check import check_perplexity, perplexity
        from service.exporters.gguf_quantize import compute_imatrix, quantize

        bin_dir = ctx.settings.llama_cpp_dir
        checks: dict[str, Any] = {}
        ppl_f16 = perplexity(f16, f16.parent, ctx.check_abort, bin_dir) if check else 0.0
        imatrix = None
        if spec.imatrix is not None:
            imatrix = compute_imatrix(
                f16, spec.imatrix.calibration, f16.parent, ctx.check_abort, bin_dir
            )
        run = quantize(
            f16, dest, spec.type, f16.parent, ctx.check_abort, ctx.advance, units,
            imatrix=imatrix, bin_dir=bin_dir,
        )  # fmt: skip
        ctx.add_metric("quantizer_peak_rss_bytes", run.peak_rss)
        f16.unlink()
        if check:
            try:
                checks["tokenizer"] = self._llama_tokenize(dest, root, ctx)
                ppl = perplexity(dest, f16.parent, ctx.check_abort, bin_dir)
                checks["perplexity"] = check_perplexity(spec.type, ppl, ppl_f16)
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
        return run.digest, {
            "quantizer": "llama-quantize",
            "quantized_from": "f16",
            "verification_of": "the f16 file llama-quantize read",
            "imatrix": imatrix is not None,
            "quantizer_peak_rss_bytes": run.peak_rss,
            **({"llama_cpp": checks} if checks else {}),
        }


register(GGUFExporter())
