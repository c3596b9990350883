"""What a request may demand of a lossy artifact's quality: ``"verify": {"max_kl": ...}``.

pydantic only: the API process validates export specs with it (``exporters.gguf.spec``).
The figures it bounds are those of :mod:`service.verification.quality` (KL, p99 KL, top-1,
top-1 on decided positions, perplexity ratio against the float source); a job fails on them
only where the request sets a threshold, with ``quality_below_threshold``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class QualityThresholds(BaseModel):
    """The worst quality figures a lossy artifact may show against the float source; a figure
    left out is reported, not judged (the margin-aware default still applies:
    ``service.verification.quality.DEFAULT_MIN_DECIDED_TOP1``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_kl: float | None = Field(
        default=None, gt=0, description="Largest mean KL(source || artifact) on the fixed text."
    )
    max_kl_p99: float | None = Field(
        default=None, gt=0, description="Largest 99th percentile of that KL over the positions."
    )
    min_top1: float | None = Field(
        default=None, ge=0, le=1,
        description="Smallest share of positions where both put the same token first.",
    )  # fmt: skip
    min_decided_top1: float | None = Field(
        default=None, ge=0, le=1,
        description="The same, counted only on positions whose reference top-1 leads its "
        "top-2 by more than the type's noise (near ties excluded).",
    )  # fmt: skip
    max_ppl_ratio: float | None = Field(
        default=None, gt=0, description="Largest perplexity(artifact) / perplexity(source)."
    )

    @model_validator(mode="after")
    def _something_set(self) -> QualityThresholds:
        if not self.set_thresholds():
            raise ValueError(
                '"verify" as an object sets at least one of max_kl, max_kl_p99, min_top1, '
                "min_decided_top1, max_ppl_ratio (true: the default checks)"
            )
        return self

    def set_thresholds(self) -> dict[str, Any]:
        """The thresholds the request set, by name."""
        return {k: v for k, v in self.model_dump().items() if v is not None}
