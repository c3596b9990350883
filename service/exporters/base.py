"""The Exporter base class and its registry: a new output format is one new package.

An exporter

* declares a pydantic spec (its ``format`` literal is the discriminator of the job's
  ``exports`` list) and may reject one at submission (``check``);
* declares its plan (``plan``: what its export holds in memory and writes to disk, from the
  checkpoint's headers, so that submission refuses a job that cannot fit) and its producers
  (``producers``: the libraries and tools whose versions key the reuse of its artifacts);
* says what it needs the job to prepare (``needs`` -> :class:`Needs`): the meta-built module
  and the offload store, and/or the source model's reference outputs on the fixed input;
* writes files into a fresh directory (``export``);
* is verified either by itself, inside ``export`` (GGUF reads its file back, NNEF runs tract
  and ONNX onnxruntime in a child process: they need no reference from the pipeline), or
  against the reference by ``verify``, which the pipeline calls in the VERIFY phase after every
  export is written (safetensors: the export is streamed through transformers).

The service only reads these declarations; nothing tests a format by name, and a format it
does not know raises :class:`UnsupportedExport` (:func:`exporter_for`). A class that lacks one
of them fails when it is defined, as a variant of llama.cpp gguf-py's ``quants.py`` does
(:meth:`Exporter.__init_subclass__`). Heavy imports (torch, gguf, torch_to_nnef) stay inside
``export`` and ``verify`` so that the API process never loads them. A new format is a package
whose ``exporter`` module registers it at import (``register(MyExporter())``), imported once
by ``service/exporters/__init__.py``; ARCHITECTURE.md says what goes in the package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from service.checkpoint.base import Checkpoint
from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings
from service.errors import UnsupportedExport
from service.plan import ExportPlan, PlanInputs
from service.plan.terms import JOB_SHARED_BYTES
from service.stage import JobContext


def _format_required(schema: dict[str, Any]) -> None:
    """``format`` is the tag of the exports union: a request must carry it, so the published
    schema requires it, though subclasses give it a default for code that builds a spec."""
    required = schema.setdefault("required", [])
    if "format" not in required:
        required.insert(0, "format")


FLOAT_DTYPE_SPELLINGS = {
    "f32": "float32", "fp32": "float32", "float": "float32",
    "f16": "float16", "fp16": "float16", "half": "float16",
    "bf16": "bfloat16",
}  # fmt: skip
"""Short names of the float dtypes, accepted wherever a spec takes ``float32``, ``float16`` or
``bfloat16`` (GGUF's own types are spelled the short way: see its spec)."""


def float_dtype_name(value: object) -> object:
    """A dtype field's value with its spelling normalised (``"BF16"`` -> ``"bfloat16"``);
    anything else unchanged, for the field's own validation to judge."""
    if not isinstance(value, str):
        return value
    low = value.strip().lower()
    return FLOAT_DTYPE_SPELLINGS.get(low, low)


class ExportSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_format_required)
    format: str


@dataclass
class ExportInputs:
    """What the job has prepared once and every export of the job shares."""

    checkpoint: Checkpoint
    model: Any | None = None
    """The meta-built, disk-dispatched model when the offload engine built one (else None)."""
    skeleton: Any | None = None
    """The job's one meta build, never dispatched: an exporter that rewrites modules copies it."""
    store: Any | None = None
    """The job's offload store (:class:`service.offload.store.OffloadStore`), when opened."""
    reference: Any | None = None
    """The source model's outputs (float32 tensor) on
    :func:`service.verification.reference.fixed_input_ids`, computed once when an export's
    :class:`Needs` asks for it and the model could be built."""
    independent: Any | None = None
    """The source as transformers' own ``from_pretrained`` computes it
    (:class:`service.verification.independent.IndependentReference`: outputs on the fixed input,
    logits on the chunks of ``service.verification.logits.FIXED_TEXT``), present whenever
    ``reference`` is; ``reference`` holds its outputs."""
    max_memory: str | None = None
    """The job's RAM budget for a model's weights, for verifiers that stream a model."""
    verify_text: str | None = None
    """The request's text for the logit checks (None: the fixed text), for a verifier that
    computes a reference of its own (an unmerged LoRA's)."""


@dataclass(frozen=True)
class Needs:
    """What an export needs the job to prepare before ``export`` runs; the default is nothing
    but the checkpoint (a state-dict-level export)."""

    module: bool = False
    """The meta-built module (``inputs.skeleton``, ``inputs.model``) and the job's offload store
    holding every weight on disk (``inputs.store``). The job is refused without a usable
    config.json."""
    reference: bool = False
    """The source's reference outputs (``inputs.reference``), for :meth:`Exporter.verify`.
    Computing them dispatches the model within the job's ``max_memory``; the pipeline drops
    this need when the job has ``"verify": false``."""
    independent: bool = False
    """Only transformers' own reading of the source (``inputs.independent``: its outputs and
    fixed-text logits), for :meth:`Exporter.verify`; the job's model is not dispatched for it.
    An export whose consumer is judged against transformers directly (GGUF in llama.cpp) needs
    nothing of ours, so a checkpoint only transformers can map (fused MoE experts) still goes
    through. Dropped with ``"verify": false`` like ``reference``."""


@dataclass
class ExportResult:
    files: list[str]
    """Paths written, relative to the export's output directory."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Goes into manifest.json under this export: recipe, counts, verification errors."""
    digests: dict[str, str] = field(default_factory=dict)
    """sha256 of files hashed while being written, so finalize need not read them again."""


@dataclass(frozen=True)
class Producers:
    """What writes and checks a format's artifacts: their versions are part of the reuse key
    (:mod:`service.jobs.reuse`, so an upgrade that could change the bytes or the verdict hands
    out no artifact an older one made) and of every model card."""

    distributions: tuple[str, ...] = ()
    """Python distributions, whose installed version is looked up (``importlib.metadata``)."""
    tools: Mapping[str, str] = field(default_factory=dict)
    """Programs that are no distribution, with the version the service pins (llama.cpp)."""


REQUIRED: tuple[str, ...] = ("format", "spec_type", "producers")
"""What every concrete exporter class must set; ``plan`` and ``export`` it must define."""


class Exporter(ABC):
    """One output format: a subclass sets ``format``, ``spec_type`` and ``producers`` and defines
    ``plan`` and ``export``, or its class statement raises :class:`TypeError`; it inherits the
    defaults of ``needs`` (nothing) and ``verify`` (never called, since nothing asked for a
    reference). A base shared by formats (``common.families.GraphExporter``) says
    ``abstract=True`` in its class statement."""

    format: ClassVar[str]
    spec_type: ClassVar[type[ExportSpec]]
    producers: ClassVar[Producers]

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        """Refuse, when the class is defined, a format that does not declare all it must: the
        service would otherwise find out in a job (no plan: admission control guessing)."""
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        missing = [name for name in REQUIRED if not hasattr(cls, name)]
        missing += [
            name for name in ("plan", "export")
            if getattr(getattr(cls, name), "__isabstractmethod__", False)
        ]  # fmt: skip
        if missing:
            raise TypeError(
                f"the exporter {cls.__qualname__} does not declare {', '.join(missing)}: every "
                "format declares its spec, its plan and its producers (service.exporters.base)"
            )
        if not isinstance(cls.producers, Producers):
            raise TypeError(f"{cls.__qualname__}.producers is not a Producers")
        tag = cls.spec_type.model_fields.get("format")
        if tag is None or tag.default != cls.format:
            raise TypeError(
                f"{cls.__qualname__}.spec_type's format field must default to {cls.format!r}, "
                "the tag that picks this exporter"
            )

    @abstractmethod
    def plan(self, spec: ExportSpec, inputs: PlanInputs) -> ExportPlan:
        """What this export holds in memory (the job process and each child it starts) and
        writes to disk, from the checkpoint's headers alone (no weight read, no torch: the API
        process plans at submission). The format's ``plan.py`` holds the formula, over the
        terms every job shares (:mod:`service.plan.terms`)."""

    def needs(self, spec: ExportSpec) -> Needs:
        """What the job must prepare for this export (see :class:`Needs`)."""
        return Needs()

    def takes_unmerged_adapter(self, spec: ExportSpec) -> bool:
        """Whether this export writes the job's adapter apart from the weights
        (``"merge": false``: a GGUF LoRA); the default exports only weights, so the adapter
        must be merged into them."""
        return False

    def modules(self) -> tuple[str, ...]:
        """The modules ``export`` and ``verify`` import when they run (heavy imports stay out of
        the API process) that every job should find already imported: the job forkserver
        imports them once (:mod:`service.jobs.executors.preload`). Leave out what only a rare
        job uses: it would cost every job process its memory."""
        return ()

    def check(
        self, spec: ExportSpec, config: dict[str, Any] | None, settings: Settings | None = None
    ) -> None:
        """Raise :class:`service.errors.InvalidRequest` for a spec this exporter cannot honour;
        the default honours every spec.

        ``settings``: the service's (the pipeline always passes them: where the tools an exporter
        runs are installed is a setting); None only in tests of a spec alone, meaning defaults."""
        return

    def check_request(self, spec: ExportSpec, settings: Settings) -> None:
        """Submission-time checks that need no checkpoint (an extra source the spec names, say);
        run for every job, local or not. Default: nothing."""
        return

    def check_files(
        self, spec: ExportSpec, config: dict[str, Any] | None, root: Path, settings: Settings
    ) -> None:
        """:meth:`check` with the checkpoint's files (``root``) at hand: at submission for a
        local source, and in the job for every source once it is downloaded, before any work;
        the default judges the config only."""
        self.check(spec, config, settings)

    def check_headers(
        self, spec: ExportSpec, headers: CheckpointHeaders, settings: Settings
    ) -> None:
        """:meth:`check` with a remote source's headers at hand (its config and tensor names,
        read with a few range requests at submission), so that what the names alone refuse is
        refused before the download; the default judges the config only."""
        self.check(spec, headers.config, settings)

    @abstractmethod
    def export(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> ExportResult:
        """Write the export's files into ``out_dir`` (empty, inside the job's staging area)."""

    def verify(
        self, spec: ExportSpec, inputs: ExportInputs, out_dir: Path, ctx: JobContext
    ) -> dict[str, Any]:
        """Check the files in ``out_dir`` against ``inputs.reference``; the dict becomes the
        export's ``verify`` in the manifest. Called only when ``needs(spec).reference`` (or
        ``.independent``) and that reference exists; raise :class:`service.errors.VerificationFailed` beyond tolerance."""
        raise TypeError(f"the {self.format} exporter declares no reference to verify against")


_REGISTRY: dict[str, Exporter] = {}


def register(exporter: Exporter) -> Exporter:
    """Make ``exporter`` the one of its format (its package's ``exporter`` module calls this
    when imported)."""
    _REGISTRY[exporter.format] = exporter
    return exporter


def registry() -> dict[str, Exporter]:
    """Every known exporter by format; importing ``service.exporters`` fills it."""
    return dict(_REGISTRY)


def exporter_for(format_name: str) -> Exporter:
    """The exporter of ``format_name``; :class:`UnsupportedExport` naming the known formats
    when none is registered (no format is ever assumed)."""
    found = _REGISTRY.get(format_name)
    if found is None:
        raise UnsupportedExport(
            f"no exporter for the format {format_name!r} (known: {', '.join(sorted(_REGISTRY))})"
        )
    return found


def plan_export(
    spec: ExportSpec,
    headers: CheckpointHeaders,
    max_memory: int,
    verify: bool = True,
    settings: Settings | None = None,
) -> ExportPlan:
    """The plan of one export spec, by its format's own formula (:meth:`Exporter.plan`).

    ``verify`` False (the job's ``"verify": false``) turns every export's verification off;
    ``settings`` are the service's, for what a consumer may hold (None: no limit)."""
    if not verify and getattr(spec, "verify", False):
        spec = spec.model_copy(update={"verify": False})
    plan = exporter_for(spec.format).plan(spec, PlanInputs(headers, max_memory, verify, settings))
    # what the job process shares with the forkserver is the same for every format
    return replace(plan, job_shared_bytes=JOB_SHARED_BYTES)
