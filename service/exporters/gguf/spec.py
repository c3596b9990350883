"""What a GGUF export request says: the type (written directly, or by llama-quantize), the
importance matrix, verification and sharding; validated in the API process, so only pydantic
and the service's own light modules are imported here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.exporters.base import ExportSpec
from service.exporters.gguf.layout import OutType
from service.sources.base import SourceRequest
from service.units import parse_size
from service.verification.thresholds import QualityThresholds

QUANTIZER_TYPES: dict[str, str] = {
    "q2_k": "Q2_K",
    "q3_k_s": "Q3_K_S",
    "q3_k_m": "Q3_K_M",
    "q3_k_l": "Q3_K_L",
    "q4_k_s": "Q4_K_S",
    "q4_k_m": "Q4_K_M",
    "q5_k_s": "Q5_K_S",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
    "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS",
}
"""Lower-case spec spelling -> llama-quantize's own name of the type (its ftype argument)."""

GGUFType = OutType | Literal[
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ4_NL", "IQ4_XS",
]  # fmt: skip
"""Types written directly (lower case, as before) and llama-quantize's (its own spelling)."""


class GGUFImatrix(BaseModel):
    """An importance matrix for llama-quantize: computed by llama-imatrix in the job from
    calibration text, or an existing imatrix file fetched from a URI; exactly one of the two."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    calibration: str | None = Field(
        default=None, min_length=1, max_length=4 * 1024**2,
        description="Text run through the f16 model by llama-imatrix; a few thousand tokens "
        "of the model's kind of text.",
    )
    uri: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="An imatrix GGUF (llama-imatrix's output) as a source: file://, http(s):// "
        "or hf://, fetched like a model source (same roots, egress policy and cache).",
    )
    sha256: str | None = Field(
        default=None,
        description="Expected sha256 of the file at uri (and the download cache's key).",
    )

    @model_validator(mode="after")
    def _one_origin(self) -> GGUFImatrix:
        if (self.calibration is None) == (self.uri is None):
            raise ValueError('an imatrix is either "calibration" text or a "uri", exactly one')
        if self.sha256 is not None and self.uri is None:
            raise ValueError('"sha256" applies to an imatrix "uri"')
        return self

    def source_request(self) -> SourceRequest:
        assert self.uri is not None
        return SourceRequest(uri=self.uri, sha256=self.sha256)


class GGUFSpec(ExportSpec):
    format: Literal["gguf"] = "gguf"
    type: GGUFType = Field(
        default="f16",
        description="f32, f16, bf16, q8_0, q4_0 are written directly; the K-quants and IQ4 "
        "types (Q4_K_M...) are llama-quantize's, made from the f16 file and checked by "
        "llama.cpp (which needs the checkpoint's tokenizer unless verify is false). Any case: "
        "q4_k_m is Q4_K_M; float16, bfloat16 and float32 name f16, bf16 and f32.",
        examples=["Q4_K_M"],
    )
    imatrix: GGUFImatrix | None = Field(
        default=None,
        description="An importance matrix for a llama-quantize type (better low-bit quality): "
        "computed in the job from calibration text, or fetched from a uri.",
    )
    verify: bool | QualityThresholds = Field(
        default=True,
        description="Read the written file back and compare every tensor with the source "
        "within the type's error bound; for llama-quantize types also run llama.cpp on the "
        "file: tokenize a probe set (must equal the checkpoint's tokenizer) and compare "
        "perplexity with the f16's. The file's logits in llama.cpp are reported against the "
        "float source (KL, p99 KL, top-1, top-1 on decided positions, perplexity ratio, the "
        "share of near ties); an object of thresholds (max_kl, max_kl_p99, min_top1, "
        "min_decided_top1, max_ppl_ratio) also fails the job below them "
        "(quality_below_threshold). false checks only the file's layout (names, shapes, types)",
        examples=[True, {"max_kl": 0.05, "min_decided_top1": 0.95}],
    )
    max_shard_size: str | int | None = Field(
        default=None,
        description="Beyond this much tensor data (bytes, or \"2GB\", \"500MB\", \"1GiB\"), "
        "write llama.cpp's split files <name>-00001-of-0000N.gguf (load the first); a tensor "
        "larger than it gets a file of its own. Quantized types are split by llama-gguf-split, "
        "whose unit is the megabyte (10^6 bytes)",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _size_parses(cls, value: str | int | None) -> str | int | None:
        """An unparseable size is refused at submission (422), not in the job."""
        if value is not None:
            parse_size(value)
        return value

    lora: bool = Field(
        default=False,
        description='With the job\'s "adapter" and "merge": false: the base model as this '
        "GGUF, and beside it the adapter itself as a GGUF LoRA (lora-<type>.gguf, written by "
        "llama.cpp's convert_lora_to_gguf classes; f16 unless the type is f32, bf16 or q8_0) "
        "for llama.cpp's --lora; verified by llama.cpp with --lora against PEFT's run of the "
        "base with the adapter.",
    )
    pre_tokenizer_fallback: Literal["default"] | None = Field(
        default=None,
        description="When llama.cpp does not know the tokenizer's BPE pre-tokenizer (its hash), "
        "write this one instead of failing with unsupported_tokenizer; llama.cpp's tokenization "
        "may then differ from the model's. Recorded in the manifest.",
    )

    @field_validator("type", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        """``"q4_k_m"``, ``"Q4_K_M"`` and ``"F16"`` all name a type: normalise the spelling."""
        if not isinstance(value, str):
            return value
        low = value.strip().lower()
        low = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(low, low)
        return QUANTIZER_TYPES.get(low, low)

    @model_validator(mode="after")
    def _imatrix_needs_quantizer(self) -> GGUFSpec:
        if self.imatrix is not None and not self.quantized:
            raise ValueError(
                f"an importance matrix only applies to llama-quantize types, not {self.type}"
            )
        return self

    @property
    def thresholds(self) -> QualityThresholds | None:
        """The quality the request demands, when ``verify`` is an object of thresholds."""
        return self.verify if isinstance(self.verify, QualityThresholds) else None

    @property
    def quantized(self) -> bool:
        """True for the types llama-quantize makes from an f16 file."""
        return self.type.lower() in QUANTIZER_TYPES

    @property
    def runs_llama_cpp(self) -> bool:
        """llama.cpp runs the model on text in the job (imatrix, tokenize/perplexity checks)."""
        computes = self.imatrix is not None and self.imatrix.calibration is not None
        return computes or (self.quantized and bool(self.verify))
