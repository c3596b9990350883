"""What a GGUF file will hold, decided from metadata alone, before any weight is read.

Follows llama.cpp's ``convert_hf_to_gguf.py`` for the Llama family: which Hugging Face
architectures map to which GGUF architecture, the tensor names (``gguf.get_tensor_name_map``),
the q/k row permutation of ``LlamaModel.permute`` (llama.cpp's rope works on interleaved pairs,
transformers' on halves), the hyperparameter keys, and which tensors stay float32. Because every
shape and type is known here, the writer can lay out the whole file before streaming any data.

``gguf`` is imported inside functions: the API process imports this module (through the exporter
registry) only to validate specs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from service.errors import UnsupportedExport

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFWriter

    from service.checkpoint.base import TensorInfo

OutType = Literal["f32", "f16", "bf16", "q8_0", "q4_0"]


@dataclass(frozen=True)
class ArchSpec:
    """One supported family: how its config maps onto a GGUF architecture."""

    gguf_arch: str
    """A ``gguf.MODEL_ARCH`` member name (``LLAMA``, ``QWEN2``)."""
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    permute_qk: bool
    """llama.cpp's LLAMA arch uses normal (interleaved) rope: q/k rows are permuted on export."""
    vocab_order: tuple[str, ...]
    """Tokenizer encodings tried in llama.cpp's order: ``spm``, ``llama_hf``, ``gpt2``."""


SUPPORTED: tuple[ArchSpec, ...] = (
    ArchSpec(
        "LLAMA",
        ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
        ("llama", "mistral"),
        permute_qk=True,
        vocab_order=("spm", "llama_hf", "gpt2"),
    ),
    ArchSpec(
        "QWEN2",
        ("Qwen2ForCausalLM",),
        ("qwen2",),
        permute_qk=False,
        vocab_order=("spm", "gpt2"),
    ),
    ArchSpec(
        "QWEN3",
        ("Qwen3ForCausalLM",),
        ("qwen3",),
        permute_qk=False,
        vocab_order=("spm", "gpt2"),
    ),
)

_REQUIRED_HPARAMS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
)
_ROPE_TYPES = {None, "default", "linear", "llama3", "yarn"}
"""Rope scalings written the way llama.cpp expects; others (dynamic, longrope) are refused."""

FILE_TYPES: dict[str, str] = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
}


def supported_architectures() -> list[str]:
    return [name for arch in SUPPORTED for name in arch.hf_architectures]


def resolve_architecture(config: dict[str, Any]) -> ArchSpec:
    """The family of ``config`` or :class:`UnsupportedExport` naming what is supported."""
    names = config.get("architectures") or []
    model_type = config.get("model_type")
    for arch in SUPPORTED:
        if any(name in arch.hf_architectures for name in names) or (
            not names and model_type in arch.model_types
        ):
            _check_hparams(config, arch)
            return arch
    shown = ", ".join(names) if names else f"model_type {model_type!r}"
    raise UnsupportedExport(
        f"GGUF export does not support {shown}; supported: {', '.join(supported_architectures())}"
    )


def _check_hparams(config: dict[str, Any], arch: ArchSpec) -> None:
    missing = [key for key in _REQUIRED_HPARAMS if not isinstance(config.get(key), int)]
    if missing:
        raise UnsupportedExport(f"config.json lacks {', '.join(missing)} needed for GGUF")
    if config.get("num_local_experts") or config.get("num_experts"):
        raise UnsupportedExport("GGUF export does not support mixture-of-experts models")
    rope_type = rope_parameters(config).get("rope_type")
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedExport(f"GGUF export does not support rope scaling {rope_type!r}")
    heads = config["num_attention_heads"]
    if arch.permute_qk and (config["hidden_size"] % heads or head_dim(config) % 2):
        raise UnsupportedExport("attention heads do not divide the hidden size evenly")


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 keeps rope settings in ``rope_parameters``; older configs split them."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    if "rope_theta" not in params and config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    return params


def head_dim(config: dict[str, Any]) -> int:
    value = config.get("head_dim")
    return int(value) if value else int(config["hidden_size"]) // int(config["num_attention_heads"])


# --- tensors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the GGUF file: where it comes from and how it is stored."""

    name: str
    """GGUF name (``blk.0.attn_q.weight``)."""
    source: str | None
    """Checkpoint tensor name, or None for a tensor computed from the config (``rope_freqs``)."""
    shape: tuple[int, ...]
    """Row-major (torch) order; the file stores it reversed, as ggml does."""
    ggml_type: int
    """A ``gguf.GGMLQuantizationType`` value."""
    nbytes: int
    permute_heads: int | None = None
    """Heads of ``LlamaModel.permute`` applied to the rows, or None."""
    values: tuple[float, ...] | None = None
    """The data of a computed tensor."""
    source_itemsize: int = 4
    """Bytes per element in the checkpoint, to ask the reader for block-sized chunks."""

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name.lower()


@dataclass(frozen=True)
class GGUFPlan:
    arch: ArchSpec
    out_type: OutType
    file_type: int
    tensors: tuple[TensorPlan, ...]
    skipped: tuple[str, ...] = ()
    """Checkpoint tensors deliberately not written (tied aliases, rotary caches)."""

    @property
    def arch_name(self) -> str:
        from gguf import MODEL_ARCH, MODEL_ARCH_NAMES

        return MODEL_ARCH_NAMES[MODEL_ARCH[self.arch.gguf_arch]]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def without_qk_permutation(self) -> GGUFPlan:
        """The same layout with q/k rows left in transformers' order (a negative control)."""
        return replace(self, tensors=tuple(replace(t, permute_heads=None) for t in self.tensors))


_SKIP_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


def plan_tensors(
    config: dict[str, Any],
    infos: list[TensorInfo],
    aliases: dict[str, str],
    out_type: OutType,
) -> GGUFPlan:
    """Map every checkpoint tensor to its GGUF name, storage type and size."""
    import gguf

    arch = resolve_architecture(config)
    n_blocks = int(config["num_hidden_layers"])
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf_arch], n_blocks)
    n_head = int(config["num_attention_heads"])
    n_head_kv = int(config.get("num_key_value_heads") or n_head)

    by_name = {info.name: info for info in infos}
    # A tied alias is written only when it is the token embedding (llama.cpp needs token_embd
    # and falls back to it for a missing output.weight); every other alias is skipped.
    candidates = [(info.name, info) for info in infos if info.name not in aliases]
    candidates += [(a, by_name[c]) for a, c in sorted(aliases.items()) if c in by_name]
    mapped: list[tuple[str, str, tuple[int, ...], int | None]] = []
    skipped: list[str] = []
    for name, info in candidates:
        new_name = None
        if not name.endswith(_SKIP_SUFFIXES):
            new_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise UnsupportedExport(
                    f"GGUF export cannot map tensor {name!r} of {arch.gguf_arch}"
                )
        if new_name is None or (name in aliases and new_name != "token_embd.weight"):
            skipped.append(name)
            continue
        heads = None
        if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_head
        elif arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_head_kv
        if heads is not None and info.shape[0] % (2 * heads):
            raise UnsupportedExport(f"{name} rows are not a multiple of 2 x {heads} heads")
        mapped.append((new_name, info.name, tuple(info.shape), heads))

    sources = {m[0]: m[1] for m in mapped}
    if "output.weight" in sources and sources["output.weight"] == sources.get("token_embd.weight"):
        # Tied, with the head stored as the canonical copy: llama.cpp reuses token_embd.
        skipped.append(next(m[1] for m in mapped if m[0] == "output.weight"))
        mapped = [m for m in mapped if m[0] != "output.weight"]
    names = [m[0] for m in mapped]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UnsupportedExport(f"several checkpoint tensors map to GGUF {twice[:3]}")
    if missing := {"token_embd.weight", "output_norm.weight"} - set(names):
        raise UnsupportedExport(f"the checkpoint has no tensor for GGUF {sorted(missing)}")
    has_output = "output.weight" in names
    tensors = [
        replace(
            _tensor(new_name, src, shape, out_type, has_output, heads),
            source_itemsize=by_name[src].dtype.itemsize,
        )
        for new_name, src, shape, heads in mapped
    ]
    if (factors := llama3_rope_factors(config)) is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        tensors.append(
            TensorPlan(
                name,
                None,
                (len(factors),),
                int(gguf.GGMLQuantizationType.F32),
                4 * len(factors),
                values=factors,
            )
        )
    file_type = int(gguf.LlamaFileType[FILE_TYPES[out_type]])
    return GGUFPlan(arch, out_type, file_type, tuple(tensors), tuple(skipped))


def _tensor(
    name: str,
    source: str,
    shape: tuple[int, ...],
    out_type: OutType,
    has_output: bool,
    heads: int | None,
) -> TensorPlan:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = choose_type(name, shape, out_type, has_output)
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    numel = math.prod(shape)
    return TensorPlan(name, source, shape, qtype, numel // block * type_size, heads)


def choose_type(name: str, shape: tuple[int, ...], out_type: OutType, has_output: bool) -> int:
    """The storage type llama.cpp would use for this tensor under ``out_type``.

    As ``ModelBase.prepare_tensors``: 1-D tensors, norms and non-weights stay F32; a quantized
    type whose block does not divide the row falls back to F16. Under q4_0 the output
    projection (``token_embd`` when tied) is kept at Q8_0, as llama-quantize keeps it at a
    higher precision (it uses Q6_K, which ``gguf.quants`` cannot produce).
    """
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return int(Q.F32)
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[out_type]
    is_output = name == "output.weight" or (name == "token_embd.weight" and not has_output)
    if qtype is Q.Q4_0 and is_output:
        qtype = Q.Q8_0
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = Q.F16
    return int(qtype)


def llama3_rope_factors(config: dict[str, Any]) -> tuple[float, ...] | None:
    """The ``rope_freqs`` tensor of ``LlamaModel.generate_extra_tensors`` for llama3 rope."""
    params = rope_parameters(config)
    if str(params.get("rope_type", "")).lower() != "llama3":
        return None
    base = float(params.get("rope_theta", 10000.0))
    dim = head_dim(config)
    factor = float(params.get("factor", 8.0))
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_ctx = float(
        params.get("original_max_position_embeddings")
        or config.get("original_max_position_embeddings")
        or 8192
    )
    factors: list[float] = []
    for i in range(0, dim, 2):
        freq = 1.0 / (base ** (i / dim))
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


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


# --- hyperparameters ---------------------------------------------------------------------------


def add_hyperparameters(
    writer: GGUFWriter, plan: GGUFPlan, config: dict[str, Any], name: str
) -> None:
    """The KV pairs of ``TextModel.set_gguf_parameters`` (+ ``LlamaModel``'s) for ``config``."""
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(int(config["num_hidden_layers"]))
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        writer.add_context_length(int(n_ctx))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    if (n_kv := config.get("num_key_value_heads")) is not None:
        writer.add_head_count_kv(int(n_kv))

    rope = rope_parameters(config)
    rope_type = rope.get("rope_type")
    factor = rope.get("factor")
    if rope_type == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(factor))
    elif rope_type == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(factor))
        orig = rope.get("original_max_position_embeddings")
        if orig is not None:
            writer.add_rope_scaling_orig_ctx_len(int(orig))
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(float(theta))
    if (eps := config.get("rms_norm_eps")) is not None:
        writer.add_layer_norm_rms_eps(float(eps))
    if (dim := config.get("head_dim")) is not None:
        writer.add_key_length(int(dim))
        writer.add_value_length(int(dim))
    writer.add_file_type(plan.file_type)
    if plan.arch.gguf_arch == "LLAMA":
        writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(head_dim(config))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
