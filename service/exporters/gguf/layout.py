"""What a GGUF file will hold, decided from metadata alone, before any weight is read.

llama.cpp's own converter decides: ``service.shims.llama_cpp_convert`` runs upstream's class for
the checkpoint's architecture (``ModelBase.from_model_architecture``) on lazy tensors fed by the
service's reader, so every architecture and pre-tokenizer the pinned llama.cpp converts is
written, with its tensor names, transforms (q/k permutation, stacked experts, norm offsets),
storage types and hyperparameter/tokenizer keys. This module turns that answer into the writer's
:class:`GGUFPlan`: a tensor upstream copies unchanged is streamed from the checkpoint in row
blocks (``source``), and so is a stack of a MoE layer's experts, one expert after the other
(``parts``); a tensor upstream transforms is evaluated once, whole (``compute``).

Measured on SmolLM2-135M (f16, same machine): hand-written Llama table vs upstream's classes gave
byte-identical tensor data; upstream also gives Gemma 1-3, Mixtral, Qwen2-MoE, Phi-3, BERT and ~250
more, and ~90 pre-tokenizer hashes, for a planning cost of about a second.

Heavy imports (``gguf``, torch, the converter) happen inside functions: the API process imports
this module (through the exporter registry) to validate specs, and answers "which architectures"
from the converter's source text alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from service.errors import ServiceError, UnsupportedExport

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFWriter

    from service.checkpoint.base import WeightReader
    from service.shims.llama_cpp_convert import ConvertedTensor

OutType = Literal["f32", "f16", "bf16", "q8_0", "q4_0"]

FILE_TYPES: dict[str, str] = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""Files any of llama.cpp's vocabulary writers reads; a checkpoint with none has no tokenizer."""


def has_tokenizer(root: Path) -> bool:
    return any((root / name).is_file() for name in TOKENIZER_FILES)


def supported_architectures(bin_dir: Path | None = None) -> list[str]:
    """Hugging Face architecture names llama.cpp's pinned converter writes."""
    from service.shims.llama_cpp_convert import supported_architectures as upstream

    return sorted(upstream(bin_dir))


def resolve_architecture(config: dict[str, Any], bin_dir: Path | None = None) -> str:
    """The architecture of ``config`` or :class:`UnsupportedExport` naming what is supported."""
    from service.shims.llama_cpp_convert import hf_architecture

    arch = hf_architecture(config)
    supported = supported_architectures(bin_dir)
    if arch not in supported:
        raise UnsupportedExport(
            f"GGUF export does not support {arch}; supported (llama.cpp's converter): "
            + ", ".join(supported)
        )
    return arch


# --- tensors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the GGUF file: where it comes from and how it is stored."""

    name: str
    """GGUF name (``blk.0.attn_q.weight``)."""
    source: str | None
    """Checkpoint tensor copied unchanged, or None for a tensor computed (``compute``, ``values``)."""
    shape: tuple[int, ...]
    """Row-major (torch) order; the file stores it reversed, as ggml does."""
    ggml_type: int
    """A ``gguf.GGMLQuantizationType`` value."""
    nbytes: int
    permute_heads: int | None = None
    """Heads of ``LlamaModel.permute`` applied to the rows, or None (plans from llama.cpp's
    converter carry the permutation inside ``compute``)."""
    values: tuple[float, ...] | None = None
    """The data of a small computed tensor."""
    source_itemsize: int = 4
    """Bytes per element in the checkpoint, to ask the reader for block-sized chunks."""
    compute: Callable[[], np.ndarray] | None = field(default=None, compare=False, repr=False)
    """Float32 values of a tensor llama.cpp's converter transforms; callable once per plan."""
    parts: tuple[str, ...] = ()
    """Checkpoint tensors whose rows, one after the other, are this tensor's (a MoE layer's
    experts, stacked by the converter on a new first dimension): each streamed like a copy."""

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name.lower()


@dataclass(frozen=True)
class GGUFPlan:
    arch_name: str
    """GGUF ``general.architecture`` (``llama``, ``gemma3``, ``bert``...)."""
    hf_architecture: str
    converter_class: str
    """The llama.cpp converter class that planned it (``LlamaModel``)."""
    out_type: OutType
    file_type: int
    tensors: tuple[TensorPlan, ...]
    skipped: tuple[str, ...] = ()
    """Checkpoint tensors deliberately not written (tied aliases, rotary caches)."""
    metadata: tuple[tuple[str, Any], ...] = ()
    """KV pairs (key, ``gguf.GGUFValue``) as llama.cpp's converter writes them."""
    pre_tokenizer_hash: str | None = None
    pre_tokenizer_fallback: str | None = None
    no_vocab_reason: str | None = None

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def computed(self) -> bool:
        """Whether a tensor is evaluated from upstream's graph (one shot: verify plans again)."""
        return any(t.compute is not None for t in self.tensors)

    def value(self, key: str) -> Any:
        """A metadata value (``tokenizer.ggml.model``...), or None."""
        for k, v in self.metadata:
            if k == key:
                return v.value
        return None


def writer_tensor(
    t: ConvertedTensor,
    qtype: int,
    aliases: dict[str, str],
    itemsize: dict[str, int],
    mismatch: type[ServiceError] = UnsupportedExport,
) -> TensorPlan:
    """Upstream's planned tensor as the writer's plan, stored as ``qtype``: names resolved
    through the reader's aliases, and the byte size recomputed from ggml's block sizes, which
    must equal upstream's when the type is upstream's own (else ``mismatch``: the two would
    write different files). One function for the text model and the projector (``mmproj``)."""
    import math

    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    nbytes = math.prod(t.shape) // block * type_size
    if qtype == t.ggml_type and nbytes != t.nbytes:
        raise mismatch(f"{t.name}: {t.nbytes} bytes planned upstream, {nbytes} here")
    source = aliases.get(t.source, t.source) if t.source else None
    parts = tuple(aliases.get(p, p) for p in t.parts)
    first = source or (parts[0] if parts else None)
    return TensorPlan(
        t.name,
        source,
        t.shape,
        qtype,
        nbytes,
        source_itemsize=itemsize.get(first, 4) if first else 4,
        compute=t.compute,
        parts=parts,
    )


def layout_gguf(
    root: Path,
    config: dict[str, Any],
    reader: WeightReader,
    out_type: OutType,
    *,
    bin_dir: Path | None = None,
    metadata: bool = True,
    vocab: bool = True,
    pre_tokenizer_fallback: str | None = None,
) -> GGUFPlan:
    """Ask llama.cpp's converter what it writes for this checkpoint under ``out_type``.

    q4_0 (not a converter type) is planned as q8_0, then every tensor llama.cpp quantizes becomes
    Q4_0 except the output projection (``token_embd`` when tied), kept at Q8_0 as llama-quantize
    keeps it at a higher precision. A tied alias is written only as the token embedding (llama.cpp
    falls back to ``token_embd`` for a missing ``output.weight``).
    """
    import gguf

    from service.shims.llama_cpp_convert import plan_conversion

    resolve_architecture(config, bin_dir)
    conversion = plan_conversion(
        root,
        config,
        reader,
        "q8_0" if out_type == "q4_0" else out_type,
        bin_dir=bin_dir,
        metadata=metadata,
        vocab=vocab,
        pre_tokenizer_fallback=pre_tokenizer_fallback,
    )
    aliases = reader.aliases()
    itemsize = {info.name: info.dtype.itemsize for info in reader.tensor_infos()}
    canonical = {t.name: aliases.get(t.source, t.source) for t in conversion.tensors if t.source}
    skipped = list(conversion.unused)
    kept = []
    for t in conversion.tensors:
        if t.source in aliases and t.name != "token_embd.weight":
            skipped.append(t.source)
            continue
        if (
            t.name == "output.weight"
            and t.source
            and canonical[t.name] == canonical.get("token_embd.weight")
        ):
            skipped.append(t.source)  # tied, stored under the head's name: llama.cpp reuses it
            continue
        kept.append(t)
    if not any(t.name == "token_embd.weight" for t in kept):
        raise UnsupportedExport("the checkpoint has no tensor for GGUF token_embd.weight")
    has_output = any(t.name == "output.weight" for t in kept)
    Q = gguf.GGMLQuantizationType
    tensors = []
    for t in kept:
        qtype = t.ggml_type
        if out_type == "q4_0" and qtype == Q.Q8_0:
            is_output = t.name == "output.weight" or (
                t.name == "token_embd.weight" and not has_output
            )
            qtype = int(Q.Q8_0 if is_output else Q.Q4_0)
        tensors.append(writer_tensor(t, int(qtype), aliases, itemsize))
    kv = tuple(conversion.metadata)
    file_type = int(gguf.LlamaFileType[FILE_TYPES[out_type]])
    if out_type == "q4_0":
        kv = tuple(
            (k, replace(v, value=file_type) if k == "general.file_type" else v) for k, v in kv
        )
    return GGUFPlan(
        arch_name=conversion.arch_name,
        hf_architecture=conversion.hf_architecture,
        converter_class=conversion.model_class,
        out_type=out_type,
        file_type=file_type,
        tensors=tuple(tensors),
        skipped=tuple(skipped),
        metadata=kv,
        pre_tokenizer_hash=conversion.pre_tokenizer_hash,
        pre_tokenizer_fallback=conversion.pre_tokenizer_fallback,
        no_vocab_reason=conversion.no_vocab_reason,
    )


def add_metadata(writer: GGUFWriter, plan: GGUFPlan) -> None:
    """Every KV pair of the plan, in llama.cpp's order (the writer already holds the arch)."""
    present = set(writer.kv_data[0])
    for key, value in plan.metadata:
        if key not in present:
            writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)


# --- q/k permutation ---------------------------------------------------------------------------


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: rows from rotate-half order to interleaved pairs."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_qk` (used to compare a GGUF tensor with its source)."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )
