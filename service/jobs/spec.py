"""What a job is asked to do: the validated request, independent of HTTP.

The exports list is a discriminated union over the formats registered in
``service.exporters``; adding an exporter module adds a format here.
"""

from __future__ import annotations

from typing import Annotated, Any, Union
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from service.exporters import registry
from service.exporters.base import ExportSpec
from service.objectstore import S3Location
from service.sources.base import SourceRequest
from service.units import parse_size


def _export_union() -> Any:
    types = tuple(exporter.spec_type for exporter in registry().values())
    if len(types) == 1:
        return types[0]
    return Annotated[Union[types], Field(discriminator="format")]  # noqa: UP007


AnyExportSpec = _export_union()


class CallbackSpec(BaseModel):
    """Where to POST the job's JSON when it ends, signed with HMAC-SHA256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        min_length=1, max_length=2048,
        description="http(s) URL that receives the job JSON, signed (X-Modelprep-Signature), "
        "once the job ends; it must answer 2xx. Subject to the egress policy.",
        examples=["https://platform.example.com/hooks/modelprep"],
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ValueError(f"not a valid URL: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            # The URL is stored and shown in the job JSON: no credentials in it.
            raise ValueError("must not contain credentials (user:password@)")
        if parts.fragment:
            raise ValueError("must not contain a #fragment")
        try:
            httpx.URL(value)  # what delivery will send to: refuse now what it could not parse
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a valid URL: {exc}") from exc
        return value


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(
        min_length=1,
        description="file:///abs/path, hf://org/repo, http(s)://host/file or "
        "s3://bucket/prefix",
        examples=["file:///models/tiny-llama"],
    )
    exports: list[AnyExportSpec] = Field(  # type: ignore[valid-type]
        min_length=1, max_length=16,
        description="What to make of the checkpoint, 1 to 16 specs, each picked by its "
        f'"format" ({", ".join(sorted(registry()))}); one download, model build and offload '
        "store serve them all.",
    )
    revision: str | None = Field(default=None, description="hf:// branch, tag or commit")
    adapter: str | None = Field(
        default=None, min_length=1,
        description="A PEFT LoRA adapter trained on `source` (a directory holding "
        "adapter_config.json and adapter_model.safetensors): file:///abs/path, hf://org/repo, "
        "s3://bucket/prefix, or https://host/dir/ (both files are fetched from under it). "
        "Refused (adapter_mismatch) when a module it targets is missing from the source or has "
        "another shape.",
        examples=["file:///models/tiny-llama-lora"],
    )
    merge: bool = Field(
        default=True,
        description="With `adapter`: merge it into the source's weights tensor by tensor "
        "(W + alpha/r * B @ A, as PEFT's merge_and_unload), so every export is the merged "
        'model. false keeps it apart: every export must then write it itself ({"format": '
        '"gguf", "lora": true}: the base GGUF plus a GGUF LoRA for llama.cpp\'s --lora); '
        "other exports are refused (unmerged_adapter_unsupported).",
    )
    sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-fA-F]{64}$",
        description="Expected sha256 (hex) of an http(s):// weights file: checked after the "
        "download (checksum_mismatch), and lets identical jobs share one result at once.",
    )
    hf_token: SecretStr | None = Field(
        default=None, description="Per-job hub token; never stored, logged or returned."
    )
    max_memory: str | None = Field(
        default=None, description="CPU budget for the model's weights, e.g. 1GiB", examples=["1GiB"]
    )
    verify: bool = Field(
        default=True,
        description="Check every export against the source (numerical comparison, read-back, "
        "the consumer runtime); false skips the checks that run the model, e.g. for a "
        "checkpoint without a tokenizer.",
    )
    verify_text: str | None = Field(
        default=None, min_length=1, max_length=1024**2,
        description="The text every logit check and quality figure is computed on, instead of "
        "the fixed English text: a code, multilingual or domain model judged on its own kind of "
        "text. Its first 2 chunks of 128 tokens are scored (a shorter text is repeated). Part "
        "of the reuse key.",
    )
    reuse: bool = Field(
        default=True,
        description="Share the artifacts of a succeeded job with the same resolved source and "
        "recipe instead of computing them (the job then says reused_from); false computes "
        "anew (the new result is still offered to later jobs).",
    )
    timeout: float | None = Field(
        default=None, gt=0, le=366 * 86400,
        description="Seconds the job may run before it is killed (error job_timeout); at most "
        "the service's MODELPREP_JOB_TIMEOUT.",
    )

    callback: CallbackSpec | None = Field(
        default=None,
        description="POST the job JSON here when the job ends (succeeded, failed, cancelled, "
        "timed out), signed with HMAC-SHA256; retried with backoff.",
    )

    destination: str | None = Field(
        default=None,
        description="s3://bucket/prefix to publish this job's artifacts under (then "
        "<prefix>/<job id>/) instead of the artifact store's default; only under a prefix "
        "granted to the tenant (MODELPREP_ARTIFACT_DESTINATIONS).",
        examples=["s3://team-models/llama"],
    )

    @field_validator("destination")
    @classmethod
    def _s3_destination(cls, value: str | None) -> str | None:
        if value is not None:
            S3Location.parse(value)
        return value

    @field_validator("max_memory")
    @classmethod
    def _valid_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    def adapter_request(self, tenant: str | None = None) -> SourceRequest | None:
        """The adapter to fetch, None without one (a hub adapter at its default branch)."""
        if self.adapter is None:
            return None
        return SourceRequest(uri=self.adapter, token=self.hf_token, tenant=tenant)

    def source_request(self, tenant: str | None = None) -> SourceRequest:
        """The source to fetch; ``tenant`` picks an s3:// source's credentials."""
        return SourceRequest(
            uri=self.source, revision=self.revision, sha256=self.sha256, token=self.hf_token,
            tenant=tenant,
        )

    def stored(self) -> dict[str, Any]:
        """The spec as persisted: everything but secrets."""
        return self.model_dump(mode="json", exclude={"hf_token"}, exclude_none=True)

    def export_specs(self) -> list[ExportSpec]:
        return list(self.exports)
