"""Service settings, read from ``MODELPREP_*`` environment variables, and from the variables the
AWS SDKs, the Hugging Face tools, curl and OpenSSL read where they mean the same thing.

Precedence (:data:`STANDARD_VARIABLES`): a ``MODELPREP_*`` variable first, then the ecosystem's
own (``AWS_ENDPOINT_URL_S3`` then ``AWS_ENDPOINT_URL`` for the store, ``AWS_REGION`` then
``AWS_DEFAULT_REGION``, ``HF_ENDPOINT``, ``HF_TOKEN``, ``HTTPS_PROXY`` / ``HTTP_PROXY`` /
``NO_PROXY``, ``SSL_CERT_FILE`` then ``REQUESTS_CA_BUNDLE``, ``AWS_CA_BUNDLE`` for the object
store), then the default. Each of those is
a field of its own (named ``env_<variable>``), so ``docs/settings.md`` lists it and a test can set
it; the model validator copies the first one set into the setting the code reads and records
which variable that was (:meth:`Settings.source_of`), for start-up's log line, ``/readyz`` and
the errors that name the setting to change.

Built exactly once, by ``create_app`` or the CLI, and passed down explicitly. Child job
processes receive the settings serialized (``model_dump_json``) rather than re-reading the
environment, so a job always runs with the settings of the service that accepted it.

Why one module of over 450 lines: most of it is the one :class:`Settings` class, whose fields are
the service's whole configuration surface. pydantic-settings reads one class per environment
prefix, and each field's ``description`` and ``examples`` are the settings reference
(:func:`settings_reference` generates ``docs/settings.md`` from them; a test keeps the page
equal), so the length is the documentation, written once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from service.egress import EgressPolicy, Proxy, without_userinfo
from service.memory import MemoryBudget, default_job_budget, read_memory_limit
from service.units import parse_duration, parse_size

JOB_PROCESS_SHARE = 384 * 2**20
"""What a job process itself holds while a verifier child runs (its reference outputs, the
weights it streams, the libraries it imported): the default verifier memory is the job's budget
less this."""
QUANTIZER_BUFFER = 256 * 2**20
"""llama-quantize's row block by default (``quantizer_buffer``): some 4,600 of a 70B model's
8192-wide rows (f16 in, float32 converted, quantized out), so the quantizer's own memory is a
fraction of a 2 GiB job budget whatever the width (:func:`service.exporters.gguf.plan.plan_gguf`
states the term)."""


class ApiKeyEntry(BaseModel):
    """One configured API key: the sha256 (hex) of the key, never the key itself.

    A plain sha256 is enough because keys are 256-bit random strings made by
    ``modelprep keygen``: nothing to brute-force, so no slow hash is needed."""

    tenant: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    admin: bool = False


class S3Credentials(BaseModel):
    """One tenant's object-store key pair (``MODELPREP_S3_CREDENTIALS``); never in a job."""

    access_key_id: str = Field(min_length=1)
    secret_access_key: SecretStr
    session_token: SecretStr | None = None


STANDARD_VARIABLES: dict[str, tuple[str, ...]] = {
    "s3_endpoint": ("env_aws_endpoint_url_s3", "env_aws_endpoint_url"),
    "s3_region": ("env_aws_region", "env_aws_default_region"),
    "hf_endpoint": ("env_hf_endpoint",),
    "hf_token": ("env_hf_token",),
    "no_proxy": ("env_no_proxy",),
    "ca_bundle": ("env_ssl_cert_file", "env_requests_ca_bundle"),
    "s3_ca_bundle": ("env_aws_ca_bundle", "ca_bundle"),
}
"""A setting and the ecosystem's variables that set it when its ``MODELPREP_*`` one is unset,
in order. A fallback may be another setting of this table, resolved before it (the store's CA
bundle falls back to the general one, from whichever variable set that). ``proxy`` is resolved apart: ``HTTPS_PROXY`` and ``HTTP_PROXY`` each serve one
scheme (:attr:`Settings.proxy_routes`); the STS endpoint too (:meth:`Settings._sts_endpoint`)."""

DEFAULT = "default"
""":meth:`Settings.source_of` of a setting no variable set."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MODELPREP_", extra="ignore")

    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    data_dir: Path = Field(
        default=Path("var"),
        description="Everything the service writes: modelprep.db, jobs/<id>/{work,offload,"
        "artifacts}, cache/ (relative paths are taken from the working directory).",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the job store; default: SQLite file modelprep.db in the "
        "data directory. PostgreSQL (postgresql+psycopg://...) for several processes.",
        examples=["postgresql+psycopg://user:pass@db:5432/modelprep"],
    )
    executor: Literal["local", "procrastinate"] = Field(
        default="local",
        description="local: the API runs jobs in its own pool of processes; procrastinate: the "
        "API only queues (PostgreSQL) and `modelprep worker` processes run them.",
    )
    workers: int = Field(
        default=2, ge=1, description="Jobs run at once by one pool or worker, each in its own "
        "process.",
    )
    max_queued: int = Field(default=64, ge=0, description="Jobs waiting before POST answers 429.")
    local_roots: list[Path] = Field(
        default_factory=list,
        description="JSON list of absolute directories file:// sources may come from "
        "(symlinks leaving a root are refused).",
        examples=['["/srv/models"]'],
    )
    progress_interval_seconds: float = Field(
        default=0.25, description="How often a running job writes its progress to the store."
    )

    # distributed execution: MODELPREP_EXECUTOR=procrastinate, `modelprep worker` processes
    heartbeat_interval_seconds: float = Field(
        default=5.0, gt=0, description="How often a worker marks each job it runs as alive."
    )
    heartbeat_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A running job silent this long lost its worker; another worker retries it.",
    )
    worker_poll_seconds: float = Field(
        default=2.0,
        gt=0,
        description="Longest wait of a worker for a job it was not notified of (a retried one).",
    )
    worker_shutdown_grace_seconds: float = Field(
        default=0.0,
        ge=0,
        description="On SIGTERM a worker lets running jobs finish this long, then re-queues them.",
    )

    # sources
    hf_endpoint: str | None = Field(
        default=None, description="Hub mirror or private hub for hf:// sources; default: "
        "HF_ENDPOINT, else the hub's own.",
    )
    hf_token: SecretStr | None = Field(
        default=None, description="Hub token for hf:// sources when a job gives none (never "
        "logged or returned); default: HF_TOKEN. A token cached under ~/.cache/huggingface is "
        "never read.",
    )
    env_hf_endpoint: str | None = Field(
        default=None, validation_alias="HF_ENDPOINT",
        description="huggingface_hub's variable: the hub endpoint when MODELPREP_HF_ENDPOINT is "
        "unset.",
    )
    env_hf_token: SecretStr | None = Field(
        default=None, validation_alias="HF_TOKEN",
        description="huggingface_hub's variable: the service-wide hub token when "
        "MODELPREP_HF_TOKEN is unset.",
    )
    hf_hub_offline: bool = Field(
        default=False, validation_alias="HF_HUB_OFFLINE",
        description="huggingface_hub's variable (1, ON, YES or TRUE, as it reads them): hf:// "
        "sources are refused at submission (source_not_allowed).",
    )
    cache_max_bytes: int = Field(
        default=50 * 1024**3, description="Size of the download cache (data_dir/cache) beyond "
        "which least-recently-used entries are evicted, never while a job uses them.",
    )
    max_download_bytes: int = Field(
        default=500 * 1024**3, description="Largest source accepted (download_too_large)."
    )
    download_retries: int = Field(
        default=5, ge=0, description="Retries of a failed download (resumed with Range)."
    )
    download_backoff_seconds: float = Field(
        default=1.0, ge=0, description="First retry delay of a download; doubles per retry."
    )
    download_stall_seconds: float = Field(
        default=60.0, gt=0,
        description="A download receiving less than download_min_bytes_per_second over this "
        "long fails with download_stalled, not retried (a trickling source must not hold a worker "
        "slot).",
    )
    download_min_bytes_per_second: int = Field(
        default=1024, ge=0, description="See download_stall_seconds.",
    )
    s3_endpoint: str | None = Field(
        default=None,
        description="Endpoint URL of an S3-compatible store (MinIO, Ceph RGW, SeaweedFS) for "
        "s3:// sources and the artifact store; default: AWS_ENDPOINT_URL_S3, else "
        "AWS_ENDPOINT_URL, else AWS S3 of s3_region.",
    )
    env_aws_endpoint_url_s3: str | None = Field(
        default=None, validation_alias="AWS_ENDPOINT_URL_S3",
        description="The AWS SDKs' and CLI's variable: the store's endpoint when "
        "MODELPREP_S3_ENDPOINT is unset.",
    )
    env_aws_endpoint_url: str | None = Field(
        default=None, validation_alias="AWS_ENDPOINT_URL",
        description="The AWS SDKs' and CLI's variable for every service: the store's endpoint "
        "when neither MODELPREP_S3_ENDPOINT nor AWS_ENDPOINT_URL_S3 is set, and the STS's "
        "when AWS_ENDPOINT_URL_STS is unset.",
    )
    s3_public_endpoint: str | None = Field(
        default=None,
        description="Endpoint URL that presigned artifact URLs name, when clients reach the "
        "object store at another address than the service does (a compose network's "
        "http://objectstore:8333 is http://HOST:8333 outside it); default: s3_endpoint.",
    )
    s3_region: str = Field(
        default="us-east-1", pattern=r"^[a-z0-9-]{1,32}$",
        description="Region of s3:// sources and of the artifact store; default: AWS_REGION, "
        "else AWS_DEFAULT_REGION, else us-east-1.",
    )
    env_aws_region: str | None = Field(
        default=None, validation_alias="AWS_REGION", pattern=r"^[a-z0-9-]{1,32}$",
        description="The AWS SDKs' variable: the region when MODELPREP_S3_REGION is unset.",
    )
    env_aws_default_region: str | None = Field(
        default=None, validation_alias="AWS_DEFAULT_REGION", pattern=r"^[a-z0-9-]{1,32}$",
        description="The AWS CLI's variable: the region when neither MODELPREP_S3_REGION nor "
        "AWS_REGION is set.",
    )
    aws_profile: str | None = Field(
        default=None, validation_alias="AWS_PROFILE",
        description="The AWS SDKs' variable: the profile of the shared credentials and config "
        "files whose keys the service uses when neither the tenant nor the environment gives "
        "keys and no web identity is configured; default: default.",
    )
    aws_config_file: Path | None = Field(
        default=None, validation_alias="AWS_CONFIG_FILE",
        description="The AWS SDKs' variable: the shared config file; default: ~/.aws/config.",
    )
    aws_shared_credentials_file: Path | None = Field(
        default=None, validation_alias="AWS_SHARED_CREDENTIALS_FILE",
        description="The AWS SDKs' variable: the shared credentials file; default: "
        "~/.aws/credentials.",
    )
    s3_credentials: dict[str, S3Credentials] = Field(
        default_factory=dict,
        description='JSON {"tenant": {"access_key_id", "secret_access_key"}}: the keys a '
        "tenant's s3:// sources and destinations use; other jobs use the standard chain "
        "(AWS_* environment, web identity, the profile's shared files, container or instance "
        "credentials).",
    )
    s3_web_identity_token_file: Path | None = Field(
        default=None, validation_alias="AWS_WEB_IDENTITY_TOKEN_FILE",
        description="With AWS_ROLE_ARN: the file of a web identity token (a Kubernetes "
        "service account's projected token) that the service exchanges for temporary keys "
        "with STS AssumeRoleWithWebIdentity; re-read at each refresh (the kubelet rotates "
        "it). Used when neither the tenant nor AWS_ACCESS_KEY_ID gives keys.",
    )
    s3_role_arn: str | None = Field(
        default=None, validation_alias="AWS_ROLE_ARN",
        examples=["arn:aws:iam::123456789012:role/modelprep"],
        description="The role assumed with the web identity token (see "
        "AWS_WEB_IDENTITY_TOKEN_FILE).",
    )
    s3_role_session_name: str = Field(
        default="modelprep", validation_alias="AWS_ROLE_SESSION_NAME",
        pattern=r"^[\w+=,.@-]{2,64}$",
        description="The session name of the assumed role (the store's audit logs show it).",
    )
    s3_sts_endpoint: str | None = Field(
        default=None, validation_alias="AWS_ENDPOINT_URL_STS",
        description="Endpoint URL of the STS that AssumeRoleWithWebIdentity is sent to; "
        "default: AWS_ENDPOINT_URL, else the store's endpoint (MinIO, SeaweedFS and Ceph RGW "
        "serve STS on their S3 endpoint), else AWS STS of s3_region. The egress policy applies "
        "to it.",
    )
    artifact_store: str | None = Field(
        default=None,
        description="s3://bucket/prefix: publish every job's artifacts and manifest under "
        "<prefix>/<tenant>/<job id>/ (manifest last) instead of keeping them on local disk; "
        "API and workers then share only the database and the bucket.",
    )
    artifact_destinations: dict[str, list[str]] = Field(
        default_factory=dict,
        description='JSON {"tenant": ["s3://bucket/prefix", ...]}: where a job of the tenant '
        'may ask to publish with "destination" ("_" is open mode).',
    )
    artifact_upload_orphan_after: float = Field(
        default=86400.0, gt=0, examples=["24h"],
        description="Seconds (or 24h, 90m) after which a multipart upload still in progress "
        "under the artifact store or a granted destination is a failed publish's orphan and "
        "is aborted (at API start, then every retention_interval_seconds); longer than the "
        "upload of the largest file.",
    )
    artifact_url_seconds: int = Field(
        default=900, ge=1, le=7 * 86400,
        description="How long the presigned URL an artifact download redirects to is valid.",
    )
    job_timeout: float | None = Field(
        default=None, gt=0,
        description="Seconds a job may run (per attempt) before it is killed and fails with "
        "job_timeout; a job's own \"timeout\" may only lower it. None: no limit.",
    )
    egress_allowlist: list[str] = Field(
        default_factory=list,
        examples=['["mirror.internal", "10.0.0.0/8"]'],
        description="JSON list of host names and CIDRs that HTTP sources, redirects and "
        "callbacks may reach although not global (internal mirrors); everything else "
        "non-global (loopback, link-local, private) is refused. Through a proxy a host name "
        "listed here is not resolved by the service (the proxy resolves it).",
    )

    # how connections leave: a forward proxy, a private CA (service/egress.py)
    proxy: str | None = Field(
        default=None, examples=["http://proxy.internal:3128"],
        description="Forward proxy (HTTP CONNECT) of every outbound connection: hub, HTTP "
        "sources, object store, STS, callbacks; default: HTTPS_PROXY for https:// targets and "
        "HTTP_PROXY for http:// ones. A target the egress policy refuses is refused before the "
        "proxy is asked.",
    )
    env_https_proxy: str | None = Field(
        default=None, validation_alias="HTTPS_PROXY",
        description="curl's and requests' variable (https_proxy too): the proxy of https:// "
        "targets when MODELPREP_PROXY is unset.",
    )
    env_http_proxy: str | None = Field(
        default=None, validation_alias="HTTP_PROXY",
        description="curl's and requests' variable (http_proxy too): the proxy of http:// "
        "targets when MODELPREP_PROXY is unset.",
    )
    no_proxy: str | None = Field(
        default=None, examples=["localhost,.svc.cluster.local"],
        description="Comma-separated hosts and .domain suffixes reached directly, not through "
        "the proxy; * for all; default: NO_PROXY.",
    )
    env_no_proxy: str | None = Field(
        default=None, validation_alias="NO_PROXY",
        description="curl's and requests' variable (no_proxy too): see MODELPREP_NO_PROXY.",
    )
    ca_bundle: Path | None = Field(
        default=None, examples=["/etc/ssl/certs/corporate-ca.pem"],
        description="PEM file of the CAs every TLS connection trusts (hub, HTTP sources, "
        "callbacks; the object store and STS too unless MODELPREP_S3_CA_BUNDLE or AWS_CA_BUNDLE "
        "is set; a TLS-intercepting proxy's CA); default: SSL_CERT_FILE, "
        "else REQUESTS_CA_BUNDLE, else certifi's public CAs. The llama.cpp tools and other "
        "child processes make no connection.",
    )
    env_ssl_cert_file: Path | None = Field(
        default=None, validation_alias="SSL_CERT_FILE",
        description="OpenSSL's variable: the CA bundle when MODELPREP_CA_BUNDLE is unset.",
    )
    env_requests_ca_bundle: Path | None = Field(
        default=None, validation_alias="REQUESTS_CA_BUNDLE",
        description="requests' variable: the CA bundle when neither MODELPREP_CA_BUNDLE nor "
        "SSL_CERT_FILE is set.",
    )
    s3_ca_bundle: Path | None = Field(
        default=None, examples=["/etc/ssl/certs/storage-ca.pem"],
        description="PEM file of the CAs the object store's and STS's TLS connections trust "
        "(sources, artifact store, AssumeRoleWithWebIdentity), in place of MODELPREP_CA_BUNDLE "
        "for them alone: a store inside the network signed by a private CA while the hub keeps "
        "the public roots; default: AWS_CA_BUNDLE, else the CA bundle (MODELPREP_CA_BUNDLE, "
        "SSL_CERT_FILE, REQUESTS_CA_BUNDLE), else the public CAs.",
    )
    env_aws_ca_bundle: Path | None = Field(
        default=None, validation_alias="AWS_CA_BUNDLE",
        description="The AWS SDKs' and CLI's variable: the object store's and STS's CA bundle "
        "when MODELPREP_S3_CA_BUNDLE is unset. Not used for the hub or HTTP sources.",
    )

    # completion callbacks (service/jobs/callbacks.py)
    callback_secret: SecretStr | None = Field(
        default=None,
        description="HMAC-SHA256 key that signs callbacks in open mode (no API keys); at "
        "least 16 characters. Without it, open mode refuses jobs with a callback.",
    )
    callback_secrets: dict[str, SecretStr] = Field(
        default_factory=dict,
        examples=['{"acme": "a-random-secret-of-16-or-more-characters"}'],
        description='JSON {"tenant": "secret"}: the key that signs each tenant\'s callbacks '
        "(16+ characters); a tenant without one cannot ask for a callback (422 "
        "callback_not_configured; one tenant never holds another's key).",
    )
    callback_max_attempts: int = Field(
        default=12, ge=1, description="Attempts to deliver a callback before it is failed."
    )
    callback_backoff_seconds: float = Field(
        default=2.0, gt=0, description="Delay before the second attempt; doubles per attempt."
    )
    callback_backoff_max_seconds: float = Field(
        default=900.0, gt=0, description="Longest delay between two attempts (Retry-After too)."
    )
    callback_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Time a receiver has to connect and answer one POST."
    )
    callback_poll_seconds: float = Field(
        default=1.0, gt=0, description="How often each API process and worker looks for due "
        "callbacks: the delay between a job's end and its first attempt.",
    )
    callback_concurrency: int = Field(
        default=4, ge=1, description="Callbacks one process delivers at once (a slow receiver "
        "does not hold up the others).",
    )

    # model building and offload
    trust_remote_code: bool = Field(
        default=False, description="Allow architectures that need code from the checkpoint."
    )
    offload_quota_bytes: int | None = Field(
        default=None, validation_alias="MODELPREP_OFFLOAD_QUOTA",
        description="Bytes one job may write into its offload store (offload_quota_exceeded); "
        "none: the disk's free space.",
    )
    keep_failed_offload: bool = Field(
        default=False, description="Keep a failed job's offload store, for debugging."
    )
    default_max_memory: str | None = Field(
        default=None,
        description="RAM a job's offload store may keep weights in (a job's own \"max_memory\" "
        "overrides it); default: a quarter of the job's budget (job_memory), at most 1 GiB.",
    )
    tract_max_memory: str | None = Field(
        default=None,
        description="RAM an NNEF verification may give tract, which holds every weight it runs: "
        "the whole archive when it fits, else one block at a time (at most tract_block_bytes); "
        "default: the "
        "job's budget (job_memory) less the job process's own share.",
    )
    tract_block_bytes: str = Field(
        default="256MiB",
        description="The most weight bytes tract holds at once when it checks an NNEF archive "
        "block by block: a decoder layer above it runs as its attention and its MLP, and a "
        "matrix above it in blocks of its rows. tract then needs about 64 MiB + 2 x this "
        "(576 MiB at 256 MiB, whatever the model's width: within the 640 MiB tract gets in a "
        "2.5 GiB service of two workers).",
    )
    nnef_block_bytes: str = Field(
        default="64MiB",
        description="The most bytes of one weight an NNEF export reads at a time: it writes "
        "each tensor's file in blocks of rows of this size (cast to the archive's dtype beside "
        "them), and its PyTorch forwards read a larger weight (the vocabulary) a block at a "
        "time, so the job holds no whole tensor whatever the model's width.",
    )
    ort_max_memory: str | None = Field(
        default=None,
        description="RAM an ONNX verification may give onnxruntime, whose weights are "
        "memory-mapped; default: the job's budget (job_memory) less the job process's own share.",
    )

    # the memory budget (service/memory/)
    memory_limit: int | None = Field(
        default=None,
        description="Bytes the service (API and jobs) may use; default: the limit it lives "
        "under, read once at start-up: cgroup v2 memory.max/memory.high, cgroup v1 "
        "memory.limit_in_bytes, else the host's memory.",
    )
    memory_limit_source: str = Field(
        default="", description="Where memory_limit comes from; filled in at start-up."
    )
    api_memory: int = Field(
        default=512 * 2**20,
        description="The API process's and the job forkserver's share of memory_limit, kept "
        "out of every job's budget.",
    )
    job_memory: int | None = Field(
        default=None,
        description="Bytes one job may use, its children (tract, onnxruntime, llama.cpp) "
        "included; default: (memory_limit - api_memory) / workers.",
    )
    job_cgroups: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: when the service lives under a cgroup memory limit and may create "
        "cgroups, each job runs in its own memory cgroup limited to job_memory (else the pool "
        "accounts for each job's process group itself); off: accounting only.",
    )

    llama_cpp_dir: Path | None = Field(
        default=None,
        description="Directory of the llama.cpp tools (llama-quantize, llama-perplexity...); "
        "default: the cache that scripts/build_llama_cpp.sh fills.",
    )
    quantizer_buffer: int = Field(
        default=QUANTIZER_BUFFER,
        ge=2**20,
        description="Bytes of one tensor's rows llama-quantize holds at once (its "
        "--max-buffer-size, whole MiB): the float32 conversion and the quantized rows of one "
        "row block, so no tensor is converted whole (a 70B model's embedding would be 4 GiB). "
        "The output is the same bytes whatever the block: quantization is row by row.",
        examples=["64MiB"],
    )

    # operability
    log_json: bool = Field(
        default=True, description="One JSON object per log line on stderr; false: plain text."
    )
    log_level: str = Field(
        default="INFO", description="DEBUG, INFO, WARNING or ERROR.", examples=["WARNING"]
    )

    # access control and tenant limits (see service/api/auth.py)
    api_keys: list[ApiKeyEntry] = Field(
        default_factory=list,
        examples=['[{"tenant": "acme", "sha256": "<64 hex digits: modelprep keygen>"}]'],
        description='JSON list of {"tenant", "sha256", "admin"}; none: open, loopback only.',
    )
    api_keys_file: Path | None = Field(
        default=None, description="A JSON file holding the same list, read once at start-up."
    )
    job_nice: int = Field(
        default=10, ge=0, le=19,
        description="Niceness added to job processes, so the API stays responsive under load.",
    )
    http_keep_alive_seconds: int = Field(
        default=30, ge=1,
        description="Idle keep-alive of client connections; longer than clients' own (httpx: "
        "5 s), so a client never reuses a connection the server is closing at that moment.",
    )
    metrics_open: bool = Field(
        default=False, description="Serve /metrics without a key (default: admin keys only)."
    )
    tenant_max_active: int | None = Field(
        default=None, ge=0, description="Queued plus running jobs per tenant before 429."
    )
    tenant_max_queued: int | None = Field(
        default=None, ge=0, description="Queued jobs per tenant before 429."
    )
    artifact_ttl: float | None = Field(
        default=None,
        examples=["30d"],
        description="Seconds (or 30d, 12h, 90m) after which a finished job's artifacts and work "
        "files are removed, as DELETE does; None: kept until deleted.",
    )
    retention_interval_seconds: float = Field(
        default=60.0, gt=0,
        description="How often the API looks for expired artifacts and orphaned multipart "
        "uploads.",
    )
    tenant_max_artifact_bytes: int | None = Field(
        default=None, ge=0, examples=["500GB"],
        description="Artifact bytes of a tenant's succeeded jobs whose files are not deleted, "
        "plus its queued and running jobs' reservations, before 429 (500GB style accepted); "
        "DELETE or retention frees them.",
    )

    @field_validator("artifact_ttl", "artifact_upload_orphan_after", mode="before")
    @classmethod
    def _human_duration(cls, value: object) -> object:
        if isinstance(value, str) and value.strip():
            return parse_duration(value)
        return value

    @field_validator(
        "tenant_max_artifact_bytes", "memory_limit", "api_memory", "job_memory",
        "quantizer_buffer", mode="before",
    )
    @classmethod
    def _human_size(cls, value: object) -> object:
        return parse_size(value) if isinstance(value, str) and value.strip() else value

    @model_validator(mode="after")
    def _memory_budget(self) -> Settings:
        # Resolved once, here: job processes receive these figures with the settings instead
        # of reading a limit from inside their own (smaller) job cgroup.
        if self.memory_limit is None:
            found = read_memory_limit()
            self.memory_limit, self.memory_limit_source = found.bytes, found.source
        elif not self.memory_limit_source:
            self.memory_limit_source = "MODELPREP_MEMORY_LIMIT"
        if self.job_memory is None:
            self.job_memory = default_job_budget(self.memory_limit, self.api_memory, self.workers)
        if self.job_memory <= 0:
            raise ValueError(
                f"no memory left for jobs: memory_limit {self.memory_limit} bytes "
                f"({self.memory_limit_source}) less api_memory {self.api_memory} bytes"
            )
        if self.default_max_memory is None:
            self.default_max_memory = str(min(2**30, self.job_memory // 4))
        verifier = max(self.job_memory - JOB_PROCESS_SHARE, self.job_memory // 2)
        if self.tract_max_memory is None:
            self.tract_max_memory = str(verifier)
        if self.ort_max_memory is None:
            self.ort_max_memory = str(verifier)
        return self

    @property
    def offload_memory(self) -> str:
        """``default_max_memory`` as resolved at start-up."""
        assert self.default_max_memory is not None
        return self.default_max_memory

    @property
    def memory_budget(self) -> MemoryBudget:
        """The limit and how it is shared (resolved by the validator above)."""
        assert self.memory_limit is not None and self.job_memory is not None
        return MemoryBudget(
            limit=self.memory_limit, limit_source=self.memory_limit_source,
            api_share=self.api_memory, workers=self.workers, job=self.job_memory,
        )  # fmt: skip

    @model_validator(mode="after")
    def _heartbeat_outlasts_intervals(self) -> Settings:
        # A timeout within a few intervals would retry jobs whose worker is merely slow.
        if self.heartbeat_timeout_seconds < 3 * self.heartbeat_interval_seconds:
            raise ValueError(
                "MODELPREP_HEARTBEAT_TIMEOUT_SECONDS must be at least 3 x "
                "MODELPREP_HEARTBEAT_INTERVAL_SECONDS (a slow worker is not a dead one)"
            )
        return self

    @field_validator("callback_secret")
    @classmethod
    def _strong_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("callback_secret must be at least 16 characters")
        return value

    @field_validator("callback_secrets")
    @classmethod
    def _strong_secrets(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        weak = sorted(t for t, secret in value.items() if len(secret.get_secret_value()) < 16)
        if weak:
            raise ValueError(f"callback_secrets of {', '.join(weak)}: at least 16 characters")
        return value

    @field_validator("artifact_store")
    @classmethod
    def _s3_uri(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("s3://"):
            raise ValueError("artifact_store must be an s3://bucket/prefix URI")
        return value

    @field_validator(
        "s3_web_identity_token_file", "s3_role_arn", "s3_sts_endpoint", "aws_profile",
        "aws_config_file", "aws_shared_credentials_file", "proxy", "no_proxy", "ca_bundle",
        "s3_ca_bundle", *(name for names in STANDARD_VARIABLES.values() for name in names),
        "env_https_proxy", "env_http_proxy", mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """A variable set to "" is unset, as the AWS SDKs, curl and OpenSSL read it."""
        return None if value == "" else value

    @field_validator("hf_hub_offline", mode="before")
    @classmethod
    def _hub_truthy(cls, value: object) -> object:
        """HF_HUB_OFFLINE as huggingface_hub reads it: 1, ON, YES, TRUE (any case) are true,
        anything else is false."""
        if isinstance(value, str):
            return value.strip().upper() in ("1", "ON", "YES", "TRUE")
        return value

    @field_validator("proxy", "env_https_proxy", "env_http_proxy")
    @classmethod
    def _proxy_url(cls, value: str | None) -> str | None:
        """A proxy given as host:port is an http:// one, as curl reads it."""
        if value is not None and "://" not in value:
            return "http://" + value
        return value

    @model_validator(mode="after")
    def _standard_variables(self) -> Settings:
        # Each setting of STANDARD_VARIABLES: its own variable, else the first of the
        # ecosystem's that is set, else the default; which one is recorded for messages.
        for name, fallbacks in STANDARD_VARIABLES.items():
            if name in self.model_fields_set and getattr(self, name) is not None:
                self._sources[name] = env_name(name)
                continue
            self._sources[name] = DEFAULT
            for fallback in fallbacks:
                value = getattr(self, fallback)
                if value is not None:
                    setattr(self, name, value)
                    self._sources[name] = self._sources.get(fallback) or env_name(fallback)
                    break
        if self.s3_sts_endpoint is not None:
            self._sources["s3_sts_endpoint"] = env_name("s3_sts_endpoint")
        elif self.env_aws_endpoint_url is not None:
            self.s3_sts_endpoint = self.env_aws_endpoint_url
            self._sources["s3_sts_endpoint"] = env_name("env_aws_endpoint_url")
        else:  # the store's own, else AWS STS of the region
            self._sources["s3_sts_endpoint"] = self._sources["s3_endpoint"]
        for name in ("ca_bundle", "s3_ca_bundle"):
            bundle = getattr(self, name)
            if bundle is not None and not bundle.is_file():
                raise ValueError(f"{self._sources[name]}: the CA bundle {bundle} is not a file")
        return self

    def source_of(self, name: str) -> str:
        """The variable that set the setting ``name`` (``MODELPREP_S3_ENDPOINT``,
        ``AWS_ENDPOINT_URL_S3``...), or ``default``: what a message names for the operator."""
        return self._sources.get(name) or (
            env_name(name) if name in self.model_fields_set else DEFAULT
        )

    def variables_of(self, name: str) -> str:
        """Every variable that sets ``name``, in their order of precedence, for a message
        that says how to change it: ``MODELPREP_S3_ENDPOINT, AWS_ENDPOINT_URL_S3 or
        AWS_ENDPOINT_URL``."""
        names = setting_variables(name)
        if name == "s3_sts_endpoint":
            names += ["AWS_ENDPOINT_URL", "the store's endpoint"]
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]

    def origin(self, name: str) -> str:
        """Where the setting ``name`` comes from and what sets it, for an error message:
        ``from AWS_ENDPOINT_URL_S3; set by MODELPREP_S3_ENDPOINT, AWS_ENDPOINT_URL_S3 or
        AWS_ENDPOINT_URL``."""
        source = self.source_of(name)
        where = "the default" if source == DEFAULT else f"from {source}"
        return f"{where}; set by {self.variables_of(name)}"

    @property
    def proxy_routes(self) -> Proxy:
        """The forward proxy of each target scheme: ``MODELPREP_PROXY`` for both, else
        ``HTTPS_PROXY`` and ``HTTP_PROXY``; ``no_proxy`` bypasses it."""
        no_proxy = self.no_proxy or ""
        if self.proxy is not None:
            return Proxy(self.proxy, self.proxy, no_proxy, "MODELPREP_PROXY", "MODELPREP_PROXY")
        return Proxy(self.env_http_proxy, self.env_https_proxy, no_proxy,
                     "HTTP_PROXY", "HTTPS_PROXY")

    def outbound(self) -> dict[str, dict[str, str]]:
        """Where outbound connections go and how, each with the variable it comes from
        (``{"s3_endpoint": {"value": ..., "source": "AWS_ENDPOINT_URL_S3"}}``), never a secret:
        the hub token only says whether one is set. Start-up logs it and ``/readyz`` shows it."""
        proxies = self.proxy_routes

        def entry(value: str | None, source: str, default: str) -> dict[str, str]:
            return {"value": value or default, "source": source if value else DEFAULT}

        return {
            "s3_endpoint": entry(self.s3_endpoint, self.source_of("s3_endpoint"),
                                 f"https://s3.{self.s3_region}.amazonaws.com"),
            "s3_region": {"value": self.s3_region, "source": self.source_of("s3_region")},
            "sts_endpoint": entry(self.s3_sts_endpoint or self.s3_endpoint,
                                  self.source_of("s3_sts_endpoint"),
                                  f"https://sts.{self.s3_region}.amazonaws.com"),
            "hf_endpoint": entry(self.hf_endpoint, self.source_of("hf_endpoint"),
                                 "https://huggingface.co"),
            "hf_token": entry("set" if self.hf_token else None, self.source_of("hf_token"),
                              "none"),
            "hf_hub_offline": {"value": str(self.hf_hub_offline).lower(),
                               "source": "HF_HUB_OFFLINE" if self.hf_hub_offline else DEFAULT},
            "https_proxy": entry(proxies.https and without_userinfo(proxies.https),
                                 proxies.https_source, "none"),
            "http_proxy": entry(proxies.http and without_userinfo(proxies.http),
                                proxies.http_source, "none"),
            "no_proxy": entry(self.no_proxy, self.source_of("no_proxy"), ""),
            "ca_bundle": entry(str(self.ca_bundle) if self.ca_bundle else None,
                               self.source_of("ca_bundle"), "certifi"),
            "s3_ca_bundle": entry(str(self.s3_ca_bundle) if self.s3_ca_bundle else None,
                                  self.source_of("s3_ca_bundle"), "certifi"),
        }

    @field_validator("egress_allowlist")
    @classmethod
    def _valid_allowlist(cls, value: list[str]) -> list[str]:
        if any(not entry.strip() for entry in value):
            raise ValueError("empty entry in egress_allowlist")
        return value

    @property
    def egress_policy(self) -> EgressPolicy:
        """The allowlist parsed (cheap; the entries were validated with the settings), with the
        proxy and CA bundle connections leave through."""
        return EgressPolicy.from_allowlist(
            self.egress_allowlist, proxy=self.proxy_routes, ca_bundle=self.ca_bundle,
            ca_source=self.source_of("ca_bundle"), ca_variables=self.variables_of("ca_bundle"),
        )

    @property
    def store_egress_policy(self) -> EgressPolicy:
        """:attr:`egress_policy` with the object store's CA bundle (``s3_ca_bundle``): what
        the store's and STS's requests are sent with. The hub, HTTP sources and callbacks keep
        :attr:`egress_policy`, so a store's private CA never stands in for public roots."""
        return EgressPolicy.from_allowlist(
            self.egress_allowlist, proxy=self.proxy_routes, ca_bundle=self.s3_ca_bundle,
            ca_source=self.source_of("s3_ca_bundle"),
            ca_variables=self.variables_of("s3_ca_bundle"),
        )

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


def outbound_line(outbound: dict[str, dict[str, str]]) -> str:
    """:meth:`Settings.outbound` (and the object store's credential source) as one line of
    text: ``s3_endpoint=http://x (AWS_ENDPOINT_URL_S3), ...``."""
    return ", ".join(f"{name}={entry['value'] or '-'} ({entry['source']})"
                     for name, entry in outbound.items())


def _default_text(field: str) -> str:
    info = Settings.model_fields[field]
    default = info.get_default(call_default_factory=True)
    if default is None or default == "":
        return "none"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, list | dict):
        return f"`{json.dumps(default)}`"
    if isinstance(default, Path):
        return f"`./{default}`" if not default.is_absolute() else f"`{default}`"
    if isinstance(default, int) and default >= 1024**3 and default % 1024**3 == 0:
        return f"`{default}` ({default // 1024**3} GiB)"
    return f"`{default}`"


def _fallback_text(field: str) -> str:
    """A fallback's cell of the table: its variable, or for another setting of the table that
    setting with what it falls back to in turn."""
    if field in STANDARD_VARIABLES:
        return f"`{env_name(field)}` and its fallbacks above"
    return f"`{env_name(field)}`"


def settings_reference() -> str:
    """``docs/settings.md``: every setting, generated from :class:`Settings` (``modelprep
    reference settings``; a test keeps the page equal to it)."""
    lines = [
        "# Settings",
        "",
        "<!-- Generated by `modelprep reference settings > docs/settings.md`; a test checks it. -->",
        "",
        "Every setting is an environment variable, read once at start-up by `modelprep serve` and",
        "`modelprep worker` (`make serve` passes them on). Lists and maps are JSON. A malformed",
        "value stops start-up with one line naming the variable and an example.",
        "",
        "The variables that the AWS SDKs, the Hugging Face tools, curl and OpenSSL read are read",
        "too where they mean the same thing, after the service's own: the first one set wins.",
        "Start-up logs, and `/readyz` shows under `outbound`, which value each of these took and",
        "from which variable (never a secret).",
        "",
        "| setting | then | then |",
        "|---|---|---|",
        *(f"| `{env_name(name)}` | " + " | ".join(_fallback_text(f) for f in fallbacks)
          + " |" * (3 - len(fallbacks)) for name, fallbacks in STANDARD_VARIABLES.items()),
        "| `MODELPREP_PROXY` (both schemes) | `HTTPS_PROXY` (https://), `HTTP_PROXY` (http://) | |",
        "| `AWS_ENDPOINT_URL_STS` | `AWS_ENDPOINT_URL` | the store's endpoint |",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for field, info in Settings.model_fields.items():
        meaning = (info.description or "").replace("|", "\\|")
        if info.examples:
            meaning += f" E.g. `{info.examples[0]}`."
        lines.append(f"| `{env_name(field)}` | {_default_text(field)} | {meaning} |")
    return "\n".join(lines) + "\n"


def setting_variables(name: str) -> list[str]:
    """Every variable that sets the setting ``name``, in order of precedence; a fallback that
    is a setting of its own brings its variables (``AWS_CA_BUNDLE`` is followed by the CA
    bundle's: ``MODELPREP_CA_BUNDLE``, ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``)."""
    names = [env_name(name)]
    for fallback in STANDARD_VARIABLES.get(name, ()):
        names += (setting_variables(fallback) if fallback in STANDARD_VARIABLES
                  else [env_name(fallback)])
    return names


def env_name(field: str) -> str:
    """The environment variable that sets a ``Settings`` field."""
    alias = Settings.model_fields[field].validation_alias
    if isinstance(alias, str):
        return alias
    prefix = Settings.model_config.get("env_prefix") or ""
    return f"{prefix}{field}".upper()


def example_value(field: str) -> str:
    """A valid value of a setting, as it is written in the environment."""
    info = Settings.model_fields[field]
    if info.examples:
        return str(info.examples[0])
    text = str(info.annotation)
    for marker, example in (("list", '["..."]'), ("dict", '{"key": "value"}'),
                            ("bool", "true"), ("int", "4"), ("float", "2.5"),
                            ("Path", "/srv/modelprep"), ("Literal", "")):
        if marker in text:
            if marker == "Literal":
                return str(re.findall(r"'([^']*)'", text)[0])
            return example
    return "..."


def load_settings() -> Settings:
    """``Settings()`` from the environment, or :class:`ConfigurationError` with one line that
    names the variable at fault and shows a valid value (never a pydantic traceback)."""
    from service.errors import ConfigurationError

    try:
        return Settings()
    except SettingsError as exc:  # a complex value (list, dict) that is not JSON
        found = re.search(r'field "(\w+)"', str(exc))
        if found is None or found.group(1) not in Settings.model_fields:
            raise ConfigurationError(f"invalid setting: {exc}") from None
        name = found.group(1)
        raise ConfigurationError(
            f"{env_name(name)} is not valid JSON; e.g. {env_name(name)}='{example_value(name)}'"
        ) from None
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = err.get("loc") or ()
            field = str(loc[0]) if loc else ""
            aliases = {env_name(f): f for f in Settings.model_fields}
            field = aliases.get(field, field)
            message = str(err.get("msg", "")).removeprefix("Value error, ")
            if field in Settings.model_fields:
                where = ".".join(str(p) for p in loc[1:])
                problems.append(
                    f"{env_name(field)}{' ' + where if where else ''}: {message}; e.g. "
                    f"{env_name(field)}='{example_value(field)}'"
                )
            else:
                problems.append(message)
        raise ConfigurationError("invalid setting: " + "; ".join(problems)) from None
