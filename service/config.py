"""Service settings, read from ``MODELPREP_*`` environment variables.

Built exactly once, by ``create_app`` or the CLI, and passed down explicitly. Child job
processes receive the settings serialized (``model_dump_json``) rather than re-reading the
environment, so a job always runs with the settings of the service that accepted it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MODELPREP_", extra="ignore")

    data_dir: Path = Field(default=Path("var"), description="Root of every file the service owns.")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: SQLite file under data_dir."
    )
    executor: Literal["local", "procrastinate"] = "local"
    workers: int = Field(default=2, ge=1, description="Jobs run at once by one pool/worker.")
    max_queued: int = Field(default=64, ge=0, description="Jobs waiting before POST answers 429.")
    local_roots: list[Path] = Field(
        default_factory=list, description="Directories file:// sources may come from."
    )
    cancel_grace_seconds: float = 2.0
    progress_interval_seconds: float = 0.25

    # sources
    hf_endpoint: str | None = None
    hf_token: SecretStr | None = None
    cache_max_bytes: int = 50 * 1024**3
    max_download_bytes: int = 500 * 1024**3
    download_retries: int = 5
    download_backoff_seconds: float = Field(
        default=1.0, ge=0, description="First retry delay of a download; doubles per retry."
    )

    # model building and offload
    trust_remote_code: bool = False
    offload_quota_bytes: int | None = Field(
        default=None, validation_alias="MODELPREP_OFFLOAD_QUOTA"
    )
    keep_failed_offload: bool = False
    default_max_memory: str = "1GiB"

    # operability
    log_json: bool = True
    log_level: str = "INFO"

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("local_roots")
    @classmethod
    def _absolute_roots(cls, value: list[Path]) -> list[Path]:
        roots = []
        for root in value:
            if not root.is_absolute():
                raise ValueError(f"local root {root} must be an absolute path")
            roots.append(root.resolve())
        return roots

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'modelprep.db'}"

    @property
    def jobs_dir(self) -> Path:
        """Per-job work, artifact and offload directories."""
        return self.data_dir / "jobs"

    @property
    def cache_dir(self) -> Path:
        """The download cache shared by all jobs and workers."""
        return self.data_dir / "cache"
