"""GGUF for llama.cpp: ``{"format": "gguf", "type": "f16"}`` (any case).

f32, f16, bf16, q8_0 and q4_0 are written directly: the file is laid out from metadata
(``layout``), written tensor by tensor with bounded memory and hashed on the way
(``writer``), then read back and compared with the source weights (``verify``); an export
beyond its type's error bound fails with :class:`VerificationFailed`. The K-quants and IQ4 types
(``"Q4_K_M"``...) are llama-quantize's, with its per-tensor mixtures: the same streamed f16 file
goes to the job's work directory, is verified the same way, then quantized by llama.cpp's own tool
in a child process (``quantize``), optionally with an importance matrix computed by
llama-imatrix from ``"imatrix": {"calibration": "<text>"}``, or an imatrix file given as a source
(``"imatrix": {"uri": "https://.../imatrix.gguf", "sha256": ...}``: fetched like a model source,
same allowed roots, egress policy and download cache, checked to be an imatrix GGUF).

What is written is what llama.cpp's own converter would write (``layout``): every architecture
it supports, its tensor transforms, hyperparameters and vocabulary. An architecture it does not
support is refused at submission (422, listing the supported ones); a BPE pre-tokenizer it does
not know is a typed ``unsupported_tokenizer`` failure unless the spec accepts a fallback
(``"pre_tokenizer_fallback": "default"``, recorded in the manifest); a checkpoint without a
tokenizer is refused (``missing_tokenizer``) for the types llama.cpp must run to check or
quantize, and so is what the converter's class for the architecture would fail on or llama.cpp
would not run as transformers does: a SentencePiece family without its ``tokenizer.model``
(``unsupported_tokenizer``, naming the file), a configuration llama.cpp's graph contradicts
(``assumptions``: Falcon's FFN width, Gemma 2/3's attention scale...). All of these at
submission for a local source, else right after the download, before any work in the job.

Only pydantic and the service's own modules are imported here; ``gguf``, ``numpy`` and the
tokenizer stack load inside :meth:`GGUFExporter.export`.

Why one module of over 450 lines: :meth:`GGUFExporter.export` is the order in which every GGUF
variant is made and checked (a type written directly, a llama-quantize type through its f16
file, a VLM's projector beside its text model, a LoRA beside the base), each step a call into a
module of its own (``layout``, ``writer``, ``verify``, ``quantize``, ``llama_check``,
``mtmd_check``, ``lora``, ``plan``); what stays here is that order and the submission checks that
refuse early what it would refuse late.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from service.checkpoint.vision import is_multimodal
from service.errors import (
    MissingTokenizer,
    NoModelConfig,
    UnsupportedExport,
    UnsupportedTokenizer,
)
from service.exporters.base import (
    Exporter,
    ExportInputs,
    ExportResult,
    ExportSpec,
    Needs,
    Producers,
    register,
)
from service.exporters.common.families import is_causal_lm
from service.exporters.gguf.assumptions import check_assumptions
from service.exporters.gguf.layout import OutType, has_tokenizer, resolve_architecture
from service.exporters.gguf.lora import LORA_PREFIX
from service.exporters.gguf.mmproj import (
    MMPROJ_PREFIX,
    MTMD_ON_F16,
    check_layout,
    check_layout_of_names,
    check_vlm,
    mmproj_type,
)
from service.exporters.gguf.plan import plan_gguf
from service.exporters.gguf.provenance import add_provenance
from service.exporters.gguf.spec import GGUFSpec
from service.plan import ExportPlan, PlanInputs
from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION
from service.stage import JobContext, Phase
from service.units import parse_size

if TYPE_CHECKING:
    from service.checkpoint.headers import CheckpointHeaders
    from service.config import Settings
    from service.exporters.gguf.layout import GGUFPlan

class GGUFExporter(Exporter):
    format: ClassVar[str] = "gguf"
    spec_type: ClassVar[type[ExportSpec]] = GGUFSpec
    producers: ClassVar[Producers] = Producers(
        distributions=("gguf", "sentencepiece"), tools={"llama.cpp": LLAMA_CPP_PYTHON_VERSION}
    )

    def plan(self, spec: ExportSpec, inputs: PlanInputs) -> ExportPlan:
        """The converter, the row blocks, llama-quantize and llama.cpp's checks as children
        (:func:`service.exporters.gguf.plan.plan_gguf`)."""
        assert isinstance(spec, GGUFSpec)
        return plan_gguf(spec, inputs)

    def check_headers(
        self, spec: ExportSpec, headers: CheckpointHeaders, settings: Settings
    ) -> None:
        """A remote VLM's tensor names judged as a local one's files are
        (:func:`~service.exporters.gguf.mmproj.check_layout_of_names`), before the download."""
        super().check_headers(spec, headers, settings)
        if headers.config is not None:
            check_layout_of_names(headers.config, [t.name for t in headers.tensors])

    def needs(self, spec: ExportSpec) -> Needs:
        """A verified GGUF is run by llama.cpp on the fixed text against the job's independent
        reference (transformers' from_pretrained of the source): :meth:`verify`."""
        assert isinstance(spec, GGUFSpec)
        return Needs(independent=bool(spec.verify))

    def takes_unmerged_adapter(self, spec: ExportSpec) -> bool:
        """``"lora": true`` writes the job's adapter as a GGUF LoRA beside the base."""
        assert isinstance(spec, GGUFSpec)
        return spec.lora

    def verify(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> dict[str, Any]:
        """The file's logits in llama.cpp against transformers' on the fixed text
        (``llama_check.check_logits``): the quality report, judged by the request's thresholds
        (``quality_below_threshold``) and the margin-aware default (``verification_failed``). With
        ``"lora": true``, also the base with the GGUF LoRA (``--lora``) against PEFT's run
        of the base with the adapter (``lora.verify_lora``)."""
        from service.exporters.gguf.llama_check import check_logits

        assert isinstance(spec, GGUFSpec)
        reference = inputs.independent
        if reference is None or reference.chunks is None:
            return {"logits": {"skipped": "no tokenizer: the fixed text cannot be tokenized"}}
        files = sorted(
            p for p in out_dir.glob("*.gguf") if not p.name.startswith((MMPROJ_PREFIX, LORA_PREFIX))
        )
        work = ctx.work_dir / f"gguf-logits-{out_dir.name}"
        work.mkdir(parents=True, exist_ok=True)
        # what was written first (model-independent), then what the type cost (the quality
        # report): a fault is named as one, not as a quality shortfall
        exact = self._check_exact(spec, inputs, files[0], work, ctx)
        report = check_logits(
            files[0], spec.type, reference, work, ctx.check_abort, ctx.settings.llama_cpp_dir,
            thresholds=spec.thresholds,
        )
        checked = {"logits": report, "exact": exact}
        if not spec.lora:
            return checked
        from service.exporters.gguf.lora import verify_lora

        return {**checked, "lora_logits": verify_lora(spec, inputs, out_dir, ctx)}

    @staticmethod
    def _check_exact(
        spec: GGUFSpec, inputs: ExportInputs, path: Path, work: Path, ctx: JobContext
    ) -> dict[str, Any]:
        """llama.cpp's logits against transformers' run of the file's own weights
        (``exact.check_exact``): the model-independent check of what was written."""
        from service.exporters.gguf.exact import check_exact

        checkpoint = inputs.checkpoint
        config = checkpoint.config or {}
        assert inputs.independent is not None
        # the class the job's reference ran, not config.json's name looked up again: a published
        # name transformers lacks (InternLM3) is built by its config's auto class
        model_class = inputs.independent.model_class
        if model_class is None or checkpoint.adapter_root is not None:
            return {"judged": False, "reason": "no transformers class, or an adapter merged"}
        budget = parse_size(inputs.max_memory) if inputs.max_memory else 1 << 30
        return check_exact(
            path, spec.type, inputs.independent, checkpoint.root, config, checkpoint.reader,
            model_class, budget, work / "exact", ctx.check_abort, ctx.settings.llama_cpp_dir,
        )  # fmt: skip

    def check(
        self, spec: ExportSpec, config: dict[str, Any] | None, settings: Settings | None = None
    ) -> None:
        """Refuse architectures the configured llama.cpp's converter does not write,
        vision-language models whose projector is not checked (``mmproj.check_vlm``), and
        configurations llama.cpp would not run as transformers does (``assumptions``)."""
        assert isinstance(spec, GGUFSpec)
        if config is not None:
            _check_config(spec, config, settings.llama_cpp_dir if settings else None)

    def check_request(self, spec: ExportSpec, settings: Settings) -> None:
        """An imatrix source is judged like the model's: allowed roots, egress, scheme."""
        from service.sources import check_source

        assert isinstance(spec, GGUFSpec)
        if spec.imatrix is not None and spec.imatrix.uri is not None:
            check_source(spec.imatrix.source_request(), settings)

    def check_files(
        self, spec: ExportSpec, config: dict[str, Any] | None, root: Path, settings: Settings
    ) -> None:
        """With the checkpoint's files at hand: :meth:`check`, a tokenizer where llama.cpp
        must run the model, and the tokenizer files the converter's class reads
        (:func:`_check_converter_files`). The job asks again once a remote source is
        downloaded, before any work."""
        assert isinstance(spec, GGUFSpec)
        if config is not None:
            arch = _check_config(spec, config, settings.llama_cpp_dir)
            _check_converter_files(arch, root)
            check_layout(config, root)
        self._check_tokenizer(spec, root)

    @staticmethod
    def _check_tokenizer(spec: GGUFSpec, root: Path) -> None:
        if spec.runs_llama_cpp and not has_tokenizer(root):
            computes = spec.imatrix is not None and spec.imatrix.calibration is not None
            what = "an importance matrix from calibration text" if computes else "verified " + spec.type
            raise MissingTokenizer(
                f"{what} needs the checkpoint's tokenizer (llama.cpp runs the model on text) and "
                "the checkpoint has none (no tokenizer.json, tokenizer.model, vocab.json/txt); "
                'add it, or set "verify": false on this GGUF export (without "imatrix") to skip '
                "llama.cpp's checks; f32, f16, bf16, q8_0 and q4_0 need no tokenizer"
            )

    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        from service.exporters.gguf.directory import read_directory
        from service.exporters.gguf.layout import add_metadata, layout_gguf
        from service.exporters.gguf.quantize import split_gguf
        from service.exporters.gguf.verify import VerifyReport, verify_gguf
        from service.exporters.gguf.writer import write_gguf, write_gguf_files

        assert isinstance(spec, GGUFSpec)
        checkpoint = inputs.checkpoint
        config = checkpoint.config
        if config is None:
            raise NoModelConfig("GGUF export needs the checkpoint's config.json")
        bin_dir = ctx.settings.llama_cpp_dir
        self.check_files(spec, config, checkpoint.root, ctx.settings)
        fetched = None
        if spec.imatrix is not None and spec.imatrix.uri is not None:
            from service.exporters.gguf.quantize import fetch_imatrix

            fetched = fetch_imatrix(spec.imatrix, ctx)  # before any work: a bad one fails early
        reader = checkpoint.reader
        written = cast(OutType, "f16" if spec.quantized else spec.type)
        with_vocab = has_tokenizer(checkpoint.root)

        def make_plan(metadata: bool, out_type: OutType | None = None) -> GGUFPlan:
            return layout_gguf(
                checkpoint.root, config, reader, out_type or written, bin_dir=bin_dir,
                metadata=metadata,
                vocab=with_vocab, pre_tokenizer_fallback=spec.pre_tokenizer_fallback,
            )  # fmt: skip

        plan = make_plan(metadata=True)
        projector = self._plan_projector(spec, checkpoint.root, config, reader, bin_dir)
        tokenizer = _tokenizer_summary(plan)
        if spec.runs_llama_cpp and tokenizer["model"] == "none":
            raise MissingTokenizer(
                f"{spec.type} runs llama.cpp on text (imatrix or verification) and the GGUF can "
                f"hold no vocabulary: {plan.no_vocab_reason}. llama.cpp holds BPE (tokenizer.json "
                "with a pre-tokenizer it knows), SentencePiece (tokenizer.model) and WordPiece "
                '(vocab.txt) tokenizers, not a word-level one; set "verify": false on this GGUF '
                "export (without \"imatrix\") to skip llama.cpp's checks, or use f32, f16, bf16, "
                "q8_0 or q4_0, which need no tokenizer"
            )

        name = f"model-{spec.type}.gguf"
        path = out_dir / name
        shard_bytes = None if spec.max_shard_size is None else parse_size(spec.max_shard_size)
        # Progress counts passes over the weights: the write, the read-back when verifying, and
        # llama-quantize's pass for its types (which write f16 to the work dir first).
        passes = 1 + int(bool(spec.verify)) + int(spec.quantized)
        passes += int(projector is not None and bool(spec.verify) and spec.type in MTMD_ON_F16)
        projector_bytes = (1 + int(bool(spec.verify))) * projector.data_bytes if projector else 0
        ctx.set_phase(Phase.EXPORT, total=passes * plan.data_bytes + projector_bytes, unit="bytes")
        # The read-back runs as the file is written: each block is read back from the file and
        # compared with the source's rows, read again (writer.write_gguf_files); the layout
        # check reads the finished file's directory after.
        checked = VerifyReport() if spec.verify else None

        def metadata(writer: Any) -> None:
            add_metadata(writer, plan)
            add_provenance(writer, spec, ctx.details.get("source", {}))

        extra: dict[str, Any] = {}
        if spec.quantized:
            stage = ctx.work_dir / "gguf"
            stage.mkdir(parents=True, exist_ok=True)
            written_path = stage / f"model-{written}.gguf"
            write_gguf(written_path, plan, reader, metadata, ctx, check=checked)
            report = verify_gguf(written_path, plan, reader, ctx, read_back=False)
            check = bool(spec.verify) and tokenizer.get("model", "none") != "none"
            whole = path if shard_bytes is None else stage / name
            digest, extra = self._quantize(
                spec, written_path, whole, plan.data_bytes, ctx, check, checkpoint.root, fetched,
                inputs.verify_text,
            )
            # the f16 file stays for the projector's mtmd check (below), then goes
            mtmd_text: Path | None = written_path if projector is not None else None
            if mtmd_text is None:
                written_path.unlink()
            digests = {name: digest}
            if shard_bytes is not None:
                digests = split_gguf(
                    whole, path, shard_bytes, stage, ctx.check_abort, ctx.settings.llama_cpp_dir
                )
                whole.unlink()
        else:
            digests = write_gguf_files(
                path, plan, reader, metadata, ctx, max_shard_bytes=shard_bytes, check=checked
            )
            report = verify_gguf([out_dir / n for n in digests], plan, reader, ctx, read_back=False)
            mtmd_text = out_dir / next(iter(digests))
            if projector is not None and spec.verify and spec.type in MTMD_ON_F16:
                mtmd_text = self._f16_text_file(make_plan, spec, reader, ctx)
        if checked is not None:
            report = checked
        files = list(digests)
        mmproj: dict[str, Any] | None = None
        if projector is not None:
            assert mtmd_text is not None
            try:
                mmproj = self._write_projector(
                    spec, projector, checkpoint, config, mtmd_text, out_dir, ctx
                )
            finally:
                if mtmd_text.parent != out_dir:  # the work dir's f16 text file
                    mtmd_text.unlink(missing_ok=True)
            digests[mmproj["file"]] = mmproj.pop("sha256")
            files.append(mmproj["file"])
        lora: dict[str, Any] = {}
        if spec.lora:
            from service.exporters.gguf.lora import export_lora

            lora_name, digests[lora_name], lora = export_lora(spec, inputs, out_dir, ctx)
            files.append(lora_name)
        size = sum((out_dir / n).stat().st_size for n in files)
        ctx.add_metric("bytes_written", size)

        from gguf import GGMLQuantizationType

        types: dict[str, int] = {}
        if spec.quantized:
            names = [
                GGMLQuantizationType(t.ggml_type).name
                for n in files
                for t in read_directory(out_dir / n).tensors
            ]
        else:
            names = [t.type_name for t in plan.tensors]
        for type_name in names:
            types[type_name] = types.get(type_name, 0) + 1
        summary = {
            "file": files[0],
            "files": files,
            "type": spec.type,
            "architecture": plan.arch_name,
            "hf_architecture": plan.hf_architecture,
            "converter": f"llama.cpp {LLAMA_CPP_PYTHON_VERSION} {plan.converter_class}",
            "bytes": size,
            "tensors": sum(types.values()),
            "tensor_types": types,
            **extra,
            "computed_tensors": sum(t.compute is not None for t in plan.tensors),
            "skipped": list(plan.skipped),
            "tokenizer": tokenizer,
            "verification": report.as_dict(),
            **({"mmproj": mmproj} if mmproj is not None else {}),
            **({"lora": lora} if lora else {}),
        }
        return ExportResult(files=files, summary=summary, digests=digests)

    @staticmethod
    def _plan_projector(
        spec: GGUFSpec, root: Path, config: dict[str, Any], reader: Any, bin_dir: Path | None
    ) -> GGUFPlan | None:
        """The VLM's projector planned by upstream's MmprojModel class (``mmproj``), with its
        vision tower checked present (llama.cpp #22656); None for a text model."""
        from service.exporters.gguf.mmproj import check_tower, plan_mmproj

        if not is_multimodal(config):  # a VLM outside mmproj.VLM_FAMILIES was refused before
            return None
        plan = plan_mmproj(root, config, reader, mmproj_type(spec.type), bin_dir=bin_dir)
        check_tower(plan, reader, config)
        return plan

    @staticmethod
    def _f16_text_file(
        make_plan: Callable[..., GGUFPlan], spec: GGUFSpec, reader: Any, ctx: JobContext,
    ) -> Path:
        """The text model again as f16 in the work dir, for the mtmd check of a q8_0/q4_0 VLM
        (:data:`~service.exporters.gguf.mmproj.MTMD_ON_F16`); removed after the check."""
        from service.exporters.gguf.layout import add_metadata
        from service.exporters.gguf.writer import write_gguf

        f16 = make_plan(metadata=True, out_type="f16")
        stage = ctx.work_dir / "gguf"
        stage.mkdir(parents=True, exist_ok=True)
        path = stage / "model-f16-for-mtmd.gguf"

        def metadata(writer: Any) -> None:
            add_metadata(writer, f16)
            add_provenance(writer, spec, ctx.details.get("source", {}))

        write_gguf(path, f16, reader, metadata, ctx)
        return path

    @staticmethod
    def _write_projector(
        spec: GGUFSpec,
        plan: GGUFPlan,
        checkpoint: Any,
        config: dict[str, Any],
        text_file: Path,
        out_dir: Path,
        ctx: JobContext,
    ) -> dict[str, Any]:
        """Stream the projector beside the text model, read it back like the text model, and
        with ``verify`` run llama-mtmd-cli on ``text_file`` and the projector against
        transformers (``mtmd_check``); the summary, with the file's sha256 under ``sha256``.

        For a llama-quantize type ``text_file`` is the f16 file it quantized, not the K-quant:
        the projector shipped is the same f16 (or f32) file either way, and a K-quant's own
        greedy tokens are not expected to equal transformers' (its logits move by more than the
        bound's 0.05 lead; ``llama_check`` judges them by perplexity against that f16 file), so
        the check of the projector runs with the text model it was quantized from."""
        from service.exporters.gguf.layout import add_metadata
        from service.exporters.gguf.mmproj import check_tower
        from service.exporters.gguf.mtmd_check import check_mtmd
        from service.exporters.gguf.verify import VerifyReport, verify_gguf
        from service.exporters.gguf.writer import write_gguf

        reader = checkpoint.reader
        bin_dir = ctx.settings.llama_cpp_dir
        name = f"{MMPROJ_PREFIX}model-{plan.out_type}.gguf"
        path = out_dir / name

        def metadata(writer: Any) -> None:
            add_metadata(writer, plan)
            add_provenance(writer, spec, ctx.details.get("source", {}))

        # read back block by block as it is written, like the text model (writer.write_gguf_files)
        checked = VerifyReport() if spec.verify else None
        digest = write_gguf(path, plan, reader, metadata, ctx, check=checked)
        report = verify_gguf(path, plan, reader, ctx, read_back=False)
        report = checked if checked is not None else report
        summary: dict[str, Any] = {
            "file": name,
            "type": plan.out_type,
            "architecture": plan.hf_architecture,
            "converter": f"llama.cpp {LLAMA_CPP_PYTHON_VERSION} {plan.converter_class}",
            "tensors": len(plan.tensors),
            "bytes": path.stat().st_size,
            "tower": check_tower(plan, reader, config),
            "verification": report.as_dict(),
            "sha256": digest,
        }
        if not spec.verify:
            return summary
        try:
            summary["mtmd"] = check_mtmd(
                text_file, path, checkpoint.root, config, ctx.work_dir / "gguf-mtmd",
                ctx.check_abort, bin_dir,
            )  # fmt: skip
            if spec.quantized:
                summary["mtmd"]["text_model"] = f"the f16 file llama-quantize made {spec.type} from"
            elif spec.type in MTMD_ON_F16:
                summary["mtmd"]["text_model"] = "an f16 file of the same text model (mmproj.MTMD_ON_F16)"
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return summary

    @staticmethod
    def _llama_tokenize(spec: GGUFSpec, path: Path, root: Path, ctx: JobContext) -> dict[str, Any]:
        """llama.cpp's ids of the probes against the checkpoint tokenizer's
        (``llama_check.check_tokenizer``), on a llama-quantize type's file. Not yet on the
        types written directly: llama-tokenize aborts (ggml_abort in llama_vocab's tokenize) on
        the suite's tiny byte-level BPE fixtures, and a fallback pre-tokenizer's mismatch
        would then need its own policy (the check corpus's "vocabulary one id off", a known
        miss)."""
        from service.exporters.gguf.llama_check import check_tokenizer

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
        fetched: tuple[Path, dict[str, Any]] | None = None,
        text: str | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """llama-quantize (after llama-imatrix when asked) from the verified f16 file, which the
        caller removes; with ``check``, llama.cpp's tokenization and perplexity of both files
        (no file is kept when a check fails)."""
        from service.exporters.gguf.llama_check import check_perplexity, perplexity
        from service.exporters.gguf.quantize import compute_imatrix, quantize

        bin_dir = ctx.settings.llama_cpp_dir
        checks: dict[str, Any] = {}
        ppl_f16 = perplexity(f16, f16.parent, ctx.check_abort, bin_dir, text) if check else 0.0
        imatrix = fetched[0] if fetched else None
        if spec.imatrix is not None and spec.imatrix.calibration is not None:
            imatrix = compute_imatrix(
                f16, spec.imatrix.calibration, f16.parent, ctx.check_abort, bin_dir
            )
        run = quantize(
            f16, dest, spec.type, f16.parent, ctx.check_abort, ctx.advance, units,
            imatrix=imatrix, bin_dir=bin_dir, buffer_bytes=ctx.settings.quantizer_buffer,
        )  # fmt: skip
        ctx.add_metric("quantizer_peak_rss_bytes", run.peaks.rss)
        if check:
            try:
                checks["tokenizer"] = self._llama_tokenize(spec, dest, root, ctx)
                ppl = perplexity(dest, f16.parent, ctx.check_abort, bin_dir, text)
                checks["perplexity"] = check_perplexity(spec.type, ppl, ppl_f16)
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
        return run.digest, {
            "quantizer": "llama-quantize",
            "quantized_from": "f16",
            "verification_of": "the f16 file llama-quantize read",
            "imatrix": imatrix is not None,
            **({"imatrix_source": fetched[1]} if fetched else {}),
            "quantizer_peak_rss_bytes": run.peaks.rss,
            "quantizer_peak_anon_bytes": run.peaks.anon,
            **({"llama_cpp": checks} if checks else {}),
        }


def _check_config(spec: GGUFSpec, config: dict[str, Any], bin_dir: Path | None) -> str:
    """What config.json alone says this export cannot be: the architecture (returned, as
    llama.cpp's converter names it), a VLM's projector, a configuration llama.cpp's graph does
    not follow, an encoder run as a causal LM."""
    check_vlm(config, bin_dir)
    arch = resolve_architecture(config, bin_dir)
    check_assumptions(config, arch)
    _refuse_encoder_on_text(spec, config)
    return arch


def _check_converter_files(arch: str, root: Path) -> None:
    """The tokenizer files llama.cpp's converter class for ``arch`` reads, judged from the file
    list (``shims.llama_cpp_convert.vocab``): a SentencePiece family without ``tokenizer.model``
    (:class:`UnsupportedTokenizer`), Gemma 3 without any tokenizer to size its embedding
    (:class:`MissingTokenizer`)."""
    from service.shims.llama_cpp_convert.vocab import missing_sentencepiece, unread_embedding

    if (reason := unread_embedding(arch, root)) is not None:
        raise MissingTokenizer(f"GGUF export: {reason}; add the model's tokenizer files")
    if has_tokenizer(root) and (reason := missing_sentencepiece(arch, root)) is not None:
        raise UnsupportedTokenizer(
            f"GGUF export: {reason}; add the model's own tokenizer.model to the checkpoint"
        )


def _refuse_encoder_on_text(spec: GGUFSpec, config: dict[str, Any]) -> None:
    """Refuse, at submission, what would run an encoder as a causal LM in llama.cpp.

    A K-quant's check (``llama-perplexity``) and an importance matrix (``llama-imatrix``) read
    next-token logits, which llama.cpp does not compute for an encoder (BERT, RoBERTa): the tool
    aborts, and the job failed after its export as ``verification_failed`` with a backtrace."""
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if not spec.runs_llama_cpp or not architectures:
        return
    if is_causal_lm(config) or is_multimodal(config):
        return
    computes = spec.imatrix is not None and spec.imatrix.calibration is not None
    what = "an importance matrix from calibration text" if computes else f"verified {spec.type}"
    raise UnsupportedExport(
        f"{what} runs the model as a causal LM in llama.cpp (llama-perplexity, llama-imatrix), "
        f"and {', '.join(architectures)} is an encoder, for which llama.cpp computes no "
        "next-token logits; take f16, bf16, q8_0 or q4_0 (checked by reading the file back), "
        f'or set "verify": false on this {spec.type} export (without "imatrix")'
    )


def _tokenizer_summary(plan: GGUFPlan) -> dict[str, Any]:
    """What vocabulary the file holds, for the manifest (a fallback pre-tokenizer is named)."""
    model = plan.value("tokenizer.ggml.model") or "none"
    summary: dict[str, Any] = {"model": model}
    if plan.no_vocab_reason is not None:
        summary["reason"] = plan.no_vocab_reason
    if (tokens := plan.value("tokenizer.ggml.tokens")) is not None:
        summary["tokens"] = len(tokens)
    if (merges := plan.value("tokenizer.ggml.merges")) is not None:
        summary["merges"] = len(merges)
    if (pre := plan.value("tokenizer.ggml.pre")) is not None:
        summary["pre"] = pre
    if plan.pre_tokenizer_fallback is not None:
        summary["pre_tokenizer_fallback"] = {
            "used": plan.pre_tokenizer_fallback,
            "unknown_hash": plan.pre_tokenizer_hash,
        }
    return summary


register(GGUFExporter())
