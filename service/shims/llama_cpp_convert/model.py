"""Upstream's class for a checkpoint run on its metadata only: what it would write (names,
shapes, types, KV, vocabulary), with no weight read (see the package doc).

:func:`plan_conversion` runs upstream's class as ``convert_hf_to_gguf.py`` would, except for its
hooks, which a :class:`ConversionRecorder` answers: ``index_tensors`` hands out lazy tensors read
by our reader, ``modify_tensors`` records what upstream makes of each, and for a text model
``get_vocab_base_pre`` and ``set_vocab`` record an unknown pre-tokenizer and a vocabulary
llama.cpp cannot write. What they learn is the recorder's attributes, read into a
:class:`Conversion` once the class has run (as optimum's ``ModelPatcher`` keeps a patch's state).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import ServiceError, UnsupportedExport, UnsupportedTokenizer
from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION
from service.shims.llama_cpp_convert.classes import (
    delegate_class,
    hf_architecture,
    published_layout,
    upstream_hparams,
    upstream_modify,
)
from service.shims.llama_cpp_convert.lazy import (
    ConverterReader,
    OneShot,
    leading_rows,
    picked_row,
    row_reader,
    stacked_rows,
)
from service.shims.llama_cpp_convert.loader import load_converter, mmproj_architecture

if TYPE_CHECKING:
    import numpy as np

FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
"""Output types upstream's converter plans (``--outtype``); anything else is mapped by the caller."""


def _head_of(source: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is the source's shape or its first rows (see :func:`leading_rows`)."""
    return shape == source or (
        len(shape) == len(source) >= 1 and shape[1:] == source[1:] and shape[0] <= source[0]
    )


@dataclass(frozen=True)
class ConvertedTensor:
    """One tensor of the GGUF upstream's class would write, with where its values come from."""

    name: str
    shape: tuple[int, ...]
    """Row-major (torch) order."""
    ggml_type: int
    nbytes: int
    source: str | None
    """The checkpoint tensor it is a plain copy of (values unchanged; ``shape`` may keep only
    its first rows), else None."""
    compute: Callable[[], np.ndarray] | None
    """Float32 values of a tensor upstream transforms (permutes, offsets): one shot."""
    parts: tuple[str, ...] = ()
    """The checkpoint tensors whose rows, one after the other, are this tensor's (a MoE
    layer's experts stacked on a new first dimension); ``source`` and ``compute`` are None."""


@dataclass
class Conversion:
    """What upstream's class for this checkpoint would write, with no weight read."""

    hf_architecture: str
    arch_name: str
    """GGUF ``general.architecture`` (``llama``, ``gemma3``...)."""
    model_class: str
    tensors: list[ConvertedTensor]
    metadata: list[tuple[str, Any]] = field(default_factory=list)
    """``gguf_writer.kv_data[0]`` items: key -> ``GGUFValue``, in upstream's order."""
    unused: list[str] = field(default_factory=list)
    """Checkpoint tensors upstream writes nothing for."""
    pre_tokenizer_hash: str | None = None
    pre_tokenizer_fallback: str | None = None
    """Set when the hash was unknown and the job accepted this fallback."""
    no_vocab_reason: str | None = None
    """Why ``tokenizer.ggml.model`` is ``none`` (no tokenizer files, or one llama.cpp cannot write)."""


class _Inexpressible(Exception):
    """The tokenizer is not one llama.cpp's vocabulary writers can express (word-level...)."""


def _tokenizer_json_model(root: Path) -> str | None:
    import json

    try:
        data = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return str(model.get("type")) if isinstance(model, dict) else None


class _RecordingTokenizer:
    """Passes everything to the tokenizer and keeps what ``encode`` returned first."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.first: Any = None

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        ids = self._tokenizer.encode(*args, **kwargs)
        if self.first is None:
            self.first = ids
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class ConversionRecorder:
    """Upstream's class for one checkpoint, fed lazy tensors of ``reader``, and what it did.

    The hooks of the class upstream runs (:meth:`fed_class`) are this object's methods, called
    with upstream's model instance; everything they learn is an attribute, read by
    :meth:`tensors` and :func:`plan_conversion` once the class has run.
    """

    def __init__(
        self,
        root: Path,
        reader: ConverterReader,
        model_class: Any,
        lazy_type: Any,
        *,
        mmproj: bool,
        vocab: bool,
        pre_tokenizer_fallback: str | None,
        published: dict[str, str] | None = None,
    ) -> None:
        # published: stored name -> the name upstream is handed (classes.published_layout)
        self.root, self.reader, self.published = root, reader, published or {}
        self.model_class, self.lazy_type = model_class, lazy_type
        self.mmproj = mmproj
        self.pre_tokenizer_fallback = pre_tokenizer_fallback
        self.infos: dict[str, Any] = {info.name: info for info in reader.tensor_infos()}
        """Every checkpoint tensor upstream is handed, by name."""
        # The reader's aliases name a tied text embedding's other half (``lm_head.weight``), which a
        # text class may need; a projector class is handed the stored tensors only, as upstream reads
        # them: MmprojModel.filter_tensors drops ``language_model.*`` but not ``lm_head.*``, and
        # Gemma 4's projector class (tied embeddings) failed to map the alias.
        self.aliases: set[str] = set()  # names handed that the files do not hold (a tied half)
        for alias, canonical in ({} if mmproj else reader.aliases()).items():
            if alias not in self.infos and canonical in self.infos:
                self.infos[alias] = self.infos[canonical]
                self.aliases.add(alias)
        self.renamed: dict[str, str] = {}  # upstream's name of a tensor it kept -> the stored one
        self.produced: dict[str, tuple[str, bool, Any]] = {}
        """Each tensor upstream made -> (the checkpoint tensor it came from, whether it is that
        tensor's values unchanged, upstream's tensor)."""
        self.leaves: dict[int, str] = {}
        """id of every lazy tensor handed to upstream -> its checkpoint name (kept alive in
        ``handed``, so that no id is reused while planning)."""
        self.handed: list[Any] = []
        self.stacked: dict[str, tuple[str, ...]] = {}
        """A tensor upstream stacked from checkpoint tensors -> those, in order
        (:func:`stacked_rows`)."""
        self.picked: dict[str, int] = {}
        """A tensor upstream took as one row of a checkpoint tensor -> the row
        (:func:`picked_row`)."""
        self.seen: set[str] = set()
        """Every name upstream's ``modify_tensors`` was called with."""
        self.unknown_hash: str | None = None
        """The tokenizer's pre-tokenizer hash, first found unknown to llama.cpp."""
        self.no_vocab_reason: str | None = (
            None if vocab else "the checkpoint has no tokenizer files"
        )
        """Why the file gets ``tokenizer.ggml.model = none``, once known."""
        self.keeps_break_row = mmproj and hasattr(model_class, "img_break_tok_id")
        """See :func:`~service.shims.llama_cpp_convert.classes.break_row_filtered`."""

    def fed_class(self) -> Any:
        """Upstream's class with this recorder's hooks (a projector keeps its vocabulary's: it
        writes none)."""
        hooks = _ProjectorHooks if self.mmproj else _TextModelHooks
        return type(
            f"Fed{self.model_class.__name__}",
            (hooks, self.model_class),
            {"model_arch": self.model_class.model_arch, "recorder": self},
        )

    def lazy(self, name: str) -> Any:
        """Checkpoint tensor ``name`` as upstream's lazy tensor, read by our reader if evaluated."""
        info = self.infos[name]
        lazy_type = self.lazy_type
        leaf = lazy_type(
            meta=lazy_type.meta_with_dtype_and_shape(info.dtype, tuple(info.shape)),
            args=(name,),
            func=self.reader.read,
        )
        self.leaves[id(leaf)] = name
        self.handed.append(leaf)
        return leaf

    def index_tensors(self, model: Any) -> dict[str, Any]:
        """``ModelBase.index_tensors``: every checkpoint tensor upstream keeps, as a lazy one."""
        out: dict[str, Any] = {}
        for name in self.infos:
            shown = self.published.get(name, name)
            item = model.filter_tensors((shown, lambda n=name: self.lazy(n)))
            if item is None and self.keeps_break_row and shown.endswith("embed_tokens.weight"):
                # see break_row_filtered: upstream's Pixtral class reads [IMG_BREAK]'s row of
                # the text embedding, which MmprojModel.filter_tensors drops first
                item = (shown.replace("language_model.", ""), lambda n=name: self.lazy(n))
            if item:
                self.renamed[item[0]] = name
                out[item[0]] = item[1]
        return out

    def modify_tensors(self, model: Any, data: Any, name: str, bid: int | None) -> list[Any]:
        """``modify_tensors``: upstream's outputs for one tensor, each recorded as what it is."""
        self.seen.add(name)
        try:
            outputs = list(upstream_modify(self.model_class, model, data, name, bid))
        except ValueError as exc:
            if self.renamed.get(name, name) in self.aliases and "Can not map tensor" in str(exc):
                # a tied weight's other half that the architecture has no tensor for (Command-R
                # has no output tensor: llama.cpp uses the embedding); upstream, reading the
                # files, never sees it
                return []
            raise
        for new_name, tensor in outputs:
            copied = tensor is data or leading_rows(tensor, data) is not None
            origin = self.renamed.get(name, name)
            self.produced[new_name] = (origin, copied and name in self.renamed, tensor)
            parts = stacked_rows(tensor, self.leaves)
            if parts is not None:
                self.stacked[new_name] = parts
            row = picked_row(tensor, data) if name in self.renamed else None
            if row is not None:
                self.picked[new_name] = row
        return outputs

    def get_vocab_base_pre(self, model: Any, tokenizer: Any) -> str:
        """``get_vocab_base_pre``: upstream's, with an unknown hash recorded, then refused or
        answered with the job's fallback."""
        recording = _RecordingTokenizer(tokenizer)
        try:
            return str(self.model_class.get_vocab_base_pre(model, recording))
        except NotImplementedError as exc:
            if "pre-tokenizer" not in str(exc) or recording.first is None:
                raise
            kind = _tokenizer_json_model(self.root)
            if kind not in (None, "BPE"):
                # upstream tried its byte-level BPE writer last, on a tokenizer that is not one
                raise _Inexpressible(f"llama.cpp cannot write a {kind} tokenizer") from None
            digest = sha256(str(recording.first).encode()).hexdigest()
            if self.unknown_hash is None:
                self.unknown_hash = digest
            if self.pre_tokenizer_fallback is not None:
                return self.pre_tokenizer_fallback
            raise UnsupportedTokenizer(
                f"the tokenizer's BPE pre-tokenizer (hash {digest}) is unknown to llama.cpp "
                f"{LLAMA_CPP_PYTHON_VERSION}: llama.cpp would split text differently from the "
                "Hugging Face tokenizer. Use a llama.cpp that knows it, or accept llama.cpp's "
                'generic splitting with "pre_tokenizer_fallback": "default" in the GGUF export'
            ) from None

    def set_vocab(self, model: Any) -> None:
        """``set_vocab``: upstream's, or no vocabulary where there is none to write or llama.cpp
        cannot write it (the reason recorded)."""
        if self.no_vocab_reason is None:
            try:
                self.model_class.set_vocab(model)
                return
            except _Inexpressible as exc:
                self.no_vocab_reason = str(exc)
            except ServiceError:
                raise
            except (OSError, ValueError, KeyError) as exc:
                # a tokenizer file the class reads is missing or not what it expects
                # (GemmaModel's FileNotFoundError, Phi3MiniModel's ValueError for tokenizer.model)
                detail = str(exc).replace(f"{self.root}/", "")
                raise UnsupportedTokenizer(
                    f"llama.cpp's converter ({self.model_class.__name__}) cannot write this "
                    f"checkpoint's vocabulary: {type(exc).__name__}: {detail}"
                ) from exc
        kv = model.gguf_writer.kv_data[0]
        for key in [k for k in kv if k.startswith("tokenizer.")]:
            del kv[key]  # whatever a failed writer added before it gave up
        model._set_vocab_none()

    def run(self, arch: str, config: dict[str, Any], ftype: str, metadata: bool) -> Any:
        """Upstream's model instance for ``root`` with every tensor prepared (and the KV with
        ``metadata``): what ``convert_hf_to_gguf.py`` does before writing."""
        import gguf

        model_class = self.model_class
        work = Path(self.root)
        try:
            hparams = upstream_hparams(dict(model_class.load_hparams(work, False)))
            hparams["architectures"] = hparams.get("architectures") or [arch]
            if "quantization_config" not in config:
                # The readers handled it (FP8 dequantized, a contradicted config ignored):
                # upstream must not dequantize again, or refuse a method whose tensors it never
                # sees.
                hparams.pop("quantization_config", None)
            model = self.fed_class()(
                work,
                gguf.LlamaFileType[FTYPES[ftype]],
                work / "model.gguf",
                eager=False,
                hparams=hparams,
            )
            model.prepare_tensors()
            if metadata:
                model.prepare_metadata(vocab_only=False)
        except (UnsupportedTokenizer, UnsupportedExport):
            raise
        except FileNotFoundError as exc:
            missing = Path(exc.filename).name if exc.filename else str(exc)
            kind = UnsupportedTokenizer if "token" in missing or "vocab" in missing else UnsupportedExport
            raise kind(
                f"llama.cpp's converter ({model_class.__name__}) reads a file this checkpoint "
                f"lacks: {missing}"
            ) from exc
        except (KeyError, ValueError, AssertionError, NotImplementedError, TypeError) as exc:
            raise UnsupportedExport(
                f"llama.cpp's converter ({model_class.__name__}) cannot convert this checkpoint: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return model

    def tensors(self, model: Any) -> list[ConvertedTensor]:
        """Every tensor ``model`` planned, as a copy, a row, a stack of checkpoint tensors, or
        computed once; then upstream's lazy graphs are let go (they would keep evaluated
        tensors alive)."""
        import torch

        infos, reader, lazy_type = self.infos, self.reader, self.lazy_type
        picked, stacked = self.picked, self.stacked
        tensors: list[ConvertedTensor] = []
        for name, info in model.gguf_writer.tensors[0].items():
            origin, plain, tensor = self.produced[name]
            qtype = int(info.dtype)
            shape = tuple(int(d) for d in tensor.shape)
            if plain and _head_of(tuple(infos[origin].shape), shape):
                tensors.append(ConvertedTensor(name, shape, qtype, int(info.nbytes), origin, None))
            elif name in picked and len(shape) == 1 and tuple(infos[origin].shape)[1:] == shape:
                stored = reader.aliases().get(origin, origin)
                compute = row_reader(reader, stored, picked[name], shape[0], infos[origin].dtype)
                tensors.append(ConvertedTensor(name, shape, qtype, int(info.nbytes), None, compute))
            elif name in stacked and all(
                tuple(infos[p].shape) == shape[1:] for p in stacked[name]
            ) and len(stacked[name]) == shape[0]:
                tensors.append(
                    ConvertedTensor(name, shape, qtype, int(info.nbytes), None, None, stacked[name])
                )
            else:
                if not isinstance(tensor, (lazy_type, torch.Tensor)):
                    raise UnsupportedExport(f"{name}: upstream made a {type(tensor).__name__}")
                compute = OneShot(tensor, lazy_type)
                tensors.append(ConvertedTensor(name, shape, qtype, int(info.nbytes), None, compute))
        model.gguf_writer.tensors.clear()  # its lazy graphs would keep evaluated tensors alive
        self.produced.clear()
        self.stacked.clear()
        self.picked.clear()
        self.leaves.clear()
        self.handed.clear()
        return tensors


class _ProjectorHooks:
    """The hooks of upstream's class a :class:`ConversionRecorder` answers, placed before it in
    the fed class's bases: each hands the call to the class's recorder."""

    recorder: ConversionRecorder

    def index_tensors(self, remote_hf_model_id: str | None = None) -> dict[str, Any]:
        return self.recorder.index_tensors(self)

    def modify_tensors(self, data: Any, name: str, bid: int | None) -> Iterable[Any]:
        return self.recorder.modify_tensors(self, data, name, bid)


class _TextModelHooks(_ProjectorHooks):
    """A text model's hooks: a projector's, and its vocabulary's."""

    def get_vocab_base_pre(self, tokenizer: Any) -> str:
        return self.recorder.get_vocab_base_pre(self, tokenizer)

    def set_vocab(self) -> None:
        self.recorder.set_vocab(self)


def plan_conversion(
    root: Path,
    config: dict[str, Any],
    reader: ConverterReader,
    ftype: str,
    *,
    bin_dir: Path | None = None,
    metadata: bool = True,
    vocab: bool = True,
    pre_tokenizer_fallback: str | None = None,
    mmproj: bool = False,
) -> Conversion:
    """Run upstream's class for ``root`` on metadata only: names, shapes, types, KV, vocabulary.

    Weights are read only when a :class:`ConvertedTensor`'s ``compute`` is called. ``vocab=False``
    writes ``tokenizer.ggml.model = none`` (a checkpoint without tokenizer files). ``mmproj``
    plans the multimodal projector instead of the text model: upstream's ``MmprojModel``
    subclass for the architecture (``get_model_class(arch, mmproj=True)``, what
    ``convert_hf_to_gguf.py --mmproj`` runs), which keeps the vision tower and projector
    tensors and writes the ``clip.*`` keys; it has no vocabulary.
    """
    conversion = load_converter(bin_dir)
    import gguf

    lazy_type: Any = importlib.import_module("conversion.base").LazyTorchTensor
    arch = (mmproj_architecture(config) if mmproj else None) or hf_architecture(config)
    try:
        model_class: Any = conversion.get_model_class(arch, mmproj=mmproj)
    except NotImplementedError:
        what = "a multimodal projector for" if mmproj else ""
        raise UnsupportedExport(f"llama.cpp's converter does not support {what} {arch}") from None
    model_class = delegate_class(model_class, config)
    recorder = ConversionRecorder(
        root, reader, model_class, lazy_type,
        mmproj=mmproj, vocab=vocab, pre_tokenizer_fallback=pre_tokenizer_fallback,
        published=published_layout(root, config, [i.name for i in reader.tensor_infos()]),
    )  # fmt: skip
    model = recorder.run(arch, config, ftype, metadata)
    tensors = recorder.tensors(model)
    kv = list(model.gguf_writer.kv_data[0].items()) if metadata else []
    return Conversion(
        hf_architecture=arch,
        arch_name=str(gguf.MODEL_ARCH_NAMES[model_class.model_arch]),
        model_class=model_class.__name__,
        tensors=tensors,
        metadata=kv,
        unused=sorted(recorder.renamed[n] for n in recorder.renamed if n not in recorder.seen),
        pre_tokenizer_hash=recorder.unknown_hash,
        pre_tokenizer_fallback=pre_tokenizer_fallback if recorder.unknown_hash else None,
        no_vocab_reason=recorder.no_vocab_reason,
    )
