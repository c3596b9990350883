"""Which quantized checkpoints the readers understand: an explicit list, everything else refused.

A quantized checkpoint read as if it were a float one exports its packed codes as weights
(FP8 codes reach 448 where the model's weights stay under 6; GPTQ's ``qweight`` is int32 bit
soup) and every check that shares the reader agrees with the garbage. So the judgement is made
once, from config.json's ``quantization_config`` and the tensors' names and dtypes (no data):

* **read** (:data:`SUPPORTED_METHODS`): ``fp8``, block-scaled ``float8_e4m3fn`` weights each with
  its ``<name>_scale_inv`` grid, ``weight_block_size`` ``[bm, bn]`` (DeepSeek-V3/R1 and
  Qwen3-*-FP8; ``activation_scheme`` ``dynamic``). ``service.checkpoint.fp8`` dequantizes each
  weight while it is read, as transformers' ``Fp8Dequantize`` does (float32 product, then the
  model's dtype); the scale tensors are never listed.
* **ignored**: a ``quantization_config`` the tensors contradict, i.e. no tensor is quantized
  (every weight float, no packed or scale tensors): transformers' save of a dequantized GGUF keeps
  ``{"quant_method": "gguf"}`` over bfloat16 weights. The checkpoint is read as the float one it
  is, the config is dropped from what the exporters see, and the manifest records it.
* **refused** with :class:`UnsupportedQuantization` naming the method: any other method whose
  tensors are quantized (GPTQ/AWQ packed int4, bitsandbytes, compressed-tensors, FP4...), an
  ``fp8`` config missing what it needs (a weight without its scale, no block size, static
  activation scales), and quantized tensors with no ``quantization_config`` at all (float8
  without its scales, int8 weights).

Tensor dtypes follow the safetensors header names (``"BF16"``, ``"F8_E4M3"``), so the API process
judges a local checkpoint at submission from its headers without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from service.errors import UnsupportedQuantization

SUPPORTED_METHODS = ("fp8",)
"""``quant_method`` values the readers implement."""

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""Weights in these dtypes are read as they are."""
INTEGER_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"})
"""Allowed for buffers (``position_ids``...), never for a ``weight`` or ``bias``."""
FP8_WEIGHT_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPES = frozenset({"F32", "BF16", "F16", "F8_E8M0"})
SCALE_SUFFIX = "_scale_inv"
PARAMETER_LEAVES = frozenset({"weight", "bias"})
QUANTIZATION_LEAVES = frozenset(
    {
        "qweight", "qzeros", "scales", "g_idx", "zeros",  # GPTQ, AWQ
        "absmax", "quant_map", "SCB", "weight_format",  # bitsandbytes
        "nested_absmax", "nested_quant_map",
        "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",  # compressed-tensors
        "weight_global_scale", "weight_g_idx",
        "input_scale", "activation_scale", "weight_scale_inv", "weight_scale_2",
    }
)  # fmt: skip
"""Last name components that only quantized checkpoints carry."""

DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64",
}  # fmt: skip
"""Header dtype -> torch's name for it (what messages and the manifest say)."""

Handling = Literal["none", "dequantize", "ignored"]


@dataclass(frozen=True)
class QuantizationPlan:
    """How the readers treat a checkpoint's quantization."""

    handling: Handling
    method: str | None = None
    scales: dict[str, str] = field(default_factory=dict)
    """fp8: each float8 weight -> its scale tensor."""
    block_size: tuple[int, int] | None = None
    reason: str = ""

    @property
    def hidden(self) -> frozenset[str]:
        """Stored tensors the readers do not list (the FP8 scale grids)."""
        return frozenset(self.scales.values())

    def record(self) -> dict[str, Any] | None:
        """The manifest's ``model.quantization``: None for a plain float checkpoint."""
        if self.handling == "none":
            return None
        out: dict[str, Any] = {"method": self.method, "handling": self.handling}
        if self.handling == "dequantize":
            out.update(
                weight_block_size=list(self.block_size or ()),
                dequantized_tensors=len(self.scales),
                scale_tensors_dropped=len(self.scales),
            )
        out["reason"] = self.reason
        return out


def quantization_config(config: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """(``quant_method`` lower-cased or None, the config's ``quantization_config``).

    Older compressed-tensors checkpoints say ``compression_config``; bitsandbytes ones from
    before ``quant_method`` existed say only ``load_in_4bit``/``load_in_8bit``."""
    if not config:
        return None, {}
    raw = config.get("quantization_config", config.get("compression_config"))
    if raw is None:
        return None, {}
    if not isinstance(raw, dict):
        raise UnsupportedQuantization(
            f"config.json's quantization_config is a {type(raw).__name__}, not an object"
        )
    method = raw.get("quant_method")
    if method is None and (raw.get("load_in_4bit") or raw.get("load_in_8bit")):
        method = "bitsandbytes"
    if method is None and "config_groups" in raw:
        method = "compressed-tensors"
    if not isinstance(method, str) or not method:
        raise UnsupportedQuantization(
            "config.json has a quantization_config that names no quant_method; the readers "
            f"implement {', '.join(SUPPORTED_METHODS)}"
        )
    return method.lower(), raw


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _quantized_evidence(
    tensors: Mapping[str, tuple[str, Sequence[int]]], exempt: frozenset[str] = frozenset()
) -> tuple[str, str] | None:
    """The first tensor (storage order) showing the checkpoint is quantized, and why."""
    for name, (dtype, _) in tensors.items():
        if name in exempt:
            continue
        leaf = _leaf(name)
        torch_name = DTYPE_NAMES.get(dtype, dtype)
        if dtype.startswith("F8_"):
            return name, f"is {torch_name}"
        if leaf in QUANTIZATION_LEAVES or "quant_state" in name:
            return name, f"is a quantization tensor ({torch_name})"
        if dtype not in FLOAT_DTYPES and (leaf in PARAMETER_LEAVES or dtype not in INTEGER_DTYPES):
            return name, f"is {torch_name}, not a float dtype"
    return None


def plan_quantization(
    config: Mapping[str, Any] | None, tensors: Mapping[str, tuple[str, Sequence[int]]]
) -> QuantizationPlan:
    """Judge ``config`` (config.json) against ``tensors`` (name -> (header dtype, shape)).

    Returns the plan, or raises :class:`UnsupportedQuantization` naming the method."""
    method, qc = quantization_config(config)
    if method == "fp8":
        return _plan_fp8(qc, tensors)
    evidence = _quantized_evidence(tensors)
    if method is None:
        if evidence is None:
            return QuantizationPlan("none")
        name, why = evidence
        hint = " (float8 without its scales)" if why.startswith("is float8") else ""
        raise UnsupportedQuantization(
            f"tensor {name!r} {why}{hint} but config.json declares no quantization_config: "
            "the readers cannot tell what its values mean"
        )
    if evidence is None:
        return QuantizationPlan(
            "ignored",
            method,
            reason=f"quantization_config names {method!r} but every weight is float: the "
            "tensors contradict it, so it was ignored and the weights read as they are",
        )
    name, why = evidence
    raise UnsupportedQuantization(
        f"quantization method {method!r} is not read by modelprep (tensor {name!r} {why}); "
        f"the readers implement {', '.join(SUPPORTED_METHODS)}",
        method=method,
    )


def _plan_fp8(
    qc: Mapping[str, Any], tensors: Mapping[str, tuple[str, Sequence[int]]]
) -> QuantizationPlan:
    fp8 = [n for n, (dtype, _) in tensors.items() if dtype == FP8_WEIGHT_DTYPE]
    scale_names = [n for n in tensors if n.endswith(SCALE_SUFFIX)]
    if not fp8 and not scale_names:
        evidence = _quantized_evidence(tensors)
        if evidence is None:
            return QuantizationPlan(
                "ignored",
                "fp8",
                reason="quantization_config names 'fp8' but no tensor is float8 and none has a "
                "scale: the tensors contradict it, so it was ignored and the weights read as "
                "they are",
            )

    def refuse(why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(f"quantization method 'fp8': {why}", method="fp8")

    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise refuse(
            f"weight_block_size is {block!r}; only block-scaled FP8 (two positive integers, "
            "e.g. [128, 128]) is read"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise refuse(f"activation_scheme {scheme!r} is not read (only 'dynamic')")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fmt {fmt!r} is not read (only 'e4m3')")
    bm, bn = int(block[0]), int(block[1])
    scales: dict[str, str] = {}
    for name in fp8:
        scale = name + SCALE_SUFFIX
        if scale not in tensors:
            raise refuse(f"float8 tensor {name!r} has no {scale!r} (float8 without its scales)")
        shape = tuple(tensors[name][1])
        sdtype, sshape = tensors[scale][0], tuple(tensors[scale][1])
        if sdtype not in FP8_SCALE_DTYPES:
            raise refuse(f"scale {scale!r} is {DTYPE_NAMES.get(sdtype, sdtype)}")
        if len(shape) < 2:
            raise refuse(f"float8 tensor {name!r} has shape {list(shape)}; blocks need 2-D")
        grid = (*shape[:-2], -(-shape[-2] // bm), -(-shape[-1] // bn))
        if sshape != grid:
            raise refuse(
                f"scale {scale!r} has shape {list(sshape)}, but {name!r} {list(shape)} in "
                f"{bm}x{bn} blocks needs {list(grid)}"
            )
        scales[name] = scale
    orphans = [s for s in scale_names if s.removesuffix(SCALE_SUFFIX) not in scales]
    if orphans:
        raise refuse(f"scale {orphans[0]!r} belongs to no float8 tensor")
    evidence = _quantized_evidence(tensors, exempt=frozenset(scales) | frozenset(scales.values()))
    if evidence is not None:
        name, why = evidence
        raise refuse(f"tensor {name!r} {why}, which block-scaled FP8 does not explain")
    return QuantizationPlan(
        "dequantize",
        "fp8",
        scales=scales,
        block_size=(bm, bn),
        reason=f"{len(scales)} float8_e4m3fn weights dequantized with their {bm}x{bn} block "
        "scales while read; the scale tensors are not exported",
    )


def without_quantization(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``config`` as the readers present it once its quantization is handled: no
    ``quantization_config`` (nor ``compression_config``)."""
    if config is None:
        return None
    return {k: v for k, v in config.items() if k not in ("quantization_config", "compression_config")}
