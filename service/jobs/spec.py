"""What a job is asked to do: the validated request, independent of HTTP.

The exports list is a discriminated union over the formats registered in
``service.exporters``; adding an exporter module adds a format here.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from service.exporters import registry
from service.exporters.base import ExportSpec
from service.sources.base import SourceRequest
from service.units import parse_size


def _export_union() -> Any:
    types = tuple(exporter.spec_type for exporter in registry().values())
    if len(types) == 1:
        return types[0]
    return Annotated[Union[types], Field(discriminator="format")]  # noqa: UP007


AnyExportSpec = _export_union()


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(
        min_length=1,
        description="file:///abs/path, hf://org/repo or http(s)://host/file",
        examples=["file:///models/tiny-llama"],
    )
    exports: list[AnyExportSpec] = Field(min_length=1, max_length=16)  # type: ignore[valid-type]
    revision: str | None = Field(default=None, description="hf:// branch, tag or commit")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    hf_token: SecretStr | None = Field(
        default=None, description="Per-job hub token; never stored, logged or returned."
    )
    max_memory: str | None = Field(
        default=None, description="CPU budget for the model's weights, e.g. 1GiB", examples=["1GiB"]
    )
    verify: bool = True
    timeout: float | None = Field(
        default=None, gt=0, le=366 * 86400,
        description="Seconds the job may run before it is killed (error job_timeout); at most "
        "the service's MODELPREP_JOB_TIMEOUT.",
    )

    @field_validator("max_memory")
    @classmethod
    def _valid_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    def source_request(self) -> SourceRequest:
        return SourceRequest(
            uri=self.source, revision=self.revision, sha256=self.sha256, token=self.hf_token
        )

    def stored(self) -> dict[str, Any]:
        """The spec as persisted: everything but secrets."""
        return self.model_dump(mode="json", exclude={"hf_token"}, exclude_none=True)

    def export_specs(self) -> list[ExportSpec]:
        return list(self.exports)
