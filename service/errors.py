"""The one exception tree of modelprep.

Every error the service raises on purpose derives from :class:`ServiceError`. Each class has a
stable ``code`` (the ``error.type`` of a failed job and the ``type`` suffix of a problem+json
body); which HTTP status each becomes is decided in ``service.api.errors`` alone. Subclasses
also inherit the matching builtin so callers can catch precisely (``except FileNotFoundError`` still works).

A failed job stores ``code`` and the message; the message must never contain a secret.

Why one module of over 450 lines: it is the one exception tree, on purpose in one file (each
class is a few lines: a ``code`` and a docstring saying when it is raised), so a caller and
``service.api.errors`` see every error the service can raise in one place.
"""

from __future__ import annotations

from typing import ClassVar


class ServiceError(Exception):
    """Root of every deliberate modelprep error."""

    code: ClassVar[str] = "service_error"
    title: ClassVar[str] = "Internal service error"

    @property
    def message(self) -> str:
        # A property, not an attribute set in __init__: with a builtin base first in the MRO
        # (PermissionError, OSError), ServiceError.__init__ is never called.
        return str(self.args[0]) if self.args else self.title


# --- requests ----------------------------------------------------------------------------------


class InvalidRequest(ValueError, ServiceError):
    """The request is well-formed JSON but asks for something impossible."""

    code = "invalid_request"
    title = "Invalid request"


class UnsupportedDtype(InvalidRequest):
    code = "unsupported_dtype"
    title = "Unsupported dtype"


class UnsupportedExport(InvalidRequest):
    """The export format, or the architecture for that format, is not supported."""

    code = "unsupported_export"
    title = "Unsupported export"


class CallbackNotConfigured(InvalidRequest):
    """A job asks for a completion callback but the service holds no key to sign it for the
    caller (``MODELPREP_CALLBACK_SECRETS`` for a tenant, ``MODELPREP_CALLBACK_SECRET`` in open
    mode): an unsigned callback could not be told from a forged one."""

    code = "callback_not_configured"
    title = "Callbacks not configured"


class UnsupportedTokenizer(UnsupportedExport):
    """The checkpoint's tokenizer cannot be written faithfully (e.g. a BPE pre-tokenizer llama.cpp
    does not know): the artifact would tokenize differently from the source model."""

    code = "unsupported_tokenizer"
    title = "Unsupported tokenizer"


class MissingTokenizer(UnsupportedExport):
    """The export needs the checkpoint's tokenizer (llama.cpp runs the model to check or to
    quantize it) and the checkpoint has none."""

    code = "missing_tokenizer"
    title = "Missing tokenizer"


class PlanDoesNotFit(InvalidRequest):
    """The job's plan (made from the checkpoint's headers before it runs) needs more memory
    than a job's budget or more disk than the data directory has free; the message names both
    numbers. ``"dry_run": true`` shows the whole plan."""

    code = "plan_does_not_fit"
    title = "The job does not fit this service"


class ImatrixNotValid(InvalidRequest):
    """The file given as a GGUF export's ``imatrix.uri`` is not an importance matrix."""

    code = "imatrix_invalid"
    title = "Invalid importance matrix"


class NotFound(LookupError, ServiceError):
    code = "not_found"
    title = "Not found"


class JobNotFound(NotFound):
    code = "job_not_found"
    title = "Job not found"


class ArtifactNotFound(NotFound):
    code = "artifact_not_found"
    title = "Artifact not found"


class ArtifactGone(ArtifactNotFound):
    """The job's artifacts were removed (``DELETE`` on the finished job, or retention)."""

    code = "artifact_gone"
    title = "Artifact removed"


class Conflict(ServiceError):
    code = "conflict"
    title = "Conflict"


class QueueFull(ServiceError):
    """Back-pressure: too many jobs are waiting."""

    code = "queue_full"
    title = "Too many queued jobs"

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unauthorized(PermissionError, ServiceError):
    code = "unauthorized"
    title = "Unauthorized"


class PathOutsideRoot(PermissionError, ServiceError):
    """A path (source, artifact) resolves outside the root it must stay in."""

    code = "path_outside_root"
    title = "Path outside allowed root"


# --- sources -----------------------------------------------------------------------------------


class SourceError(ServiceError):
    """The checkpoint could not be obtained."""

    code = "source_error"
    title = "Source error"


class SourceNotAllowed(PermissionError, SourceError):
    code = "source_not_allowed"
    title = "Source not allowed"


class EgressRefused(PermissionError, ServiceError):
    """An outbound connection (HTTP source, redirect, callback) to an address the egress policy
    refuses: loopback, link-local, private or otherwise non-global (see service/egress.py)."""

    code = "egress_refused"
    title = "Destination not allowed by the egress policy"


class SourceNotFound(FileNotFoundError, SourceError):
    code = "source_not_found"
    title = "Source not found"


class SourceUnreadable(PermissionError, SourceError):
    """A local checkpoint file the service's user may not read (a container runs as uid 1000
    while the host files it mounts keep their owner)."""

    code = "source_unreadable"
    title = "Source not readable"


class RepositoryNotFound(SourceNotFound):
    code = "repository_not_found"
    title = "Repository not found"


class RevisionNotFound(SourceNotFound):
    code = "revision_not_found"
    title = "Revision not found"


class SourceUnauthorized(PermissionError, SourceError):
    """Gated or private repository, or a rejected token."""

    code = "source_unauthorized"
    title = "Source refused access"


class ObjectNotFound(SourceNotFound):
    """An ``s3://`` source names a bucket, prefix or object the object store does not have."""

    code = "object_not_found"
    title = "Object not found"


class AccessDenied(SourceUnauthorized):
    """The object store refused the credentials (unknown key, bad signature, no permission)."""

    code = "access_denied"
    title = "Object store refused access"


class NoWeightFiles(SourceError):
    code = "no_weight_files"
    title = "No weight files"


class DownloadFailed(ConnectionError, SourceError):
    """Network failure that retries did not overcome."""

    code = "download_failed"
    title = "Download failed"


class SourceUnreachable(DownloadFailed):
    """The object store could not be reached (connection refused, reset, timed out) after
    retries."""

    code = "source_unreachable"
    title = "Source unreachable"


class CertificateUntrusted(ConnectionError, SourceError):
    """A TLS server's certificate is not signed by a CA the service trusts (its CA bundle:
    ``MODELPREP_CA_BUNDLE``, ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``, else certifi's; for the
    object store and STS ``MODELPREP_S3_CA_BUNDLE`` or ``AWS_CA_BUNDLE`` first). Not retried:
    another attempt meets the same certificate."""

    code = "certificate_untrusted"
    title = "Certificate not trusted"


class DownloadStalled(DownloadFailed):
    """The source sent less than ``download_min_bytes_per_second`` for
    ``download_stall_seconds``: a trickle that would hold a worker slot for days. Not retried."""

    code = "download_stalled"
    title = "Download stalled"


class ChecksumMismatch(SourceError):
    code = "checksum_mismatch"
    title = "Checksum mismatch"


class DownloadTooLarge(SourceError):
    code = "download_too_large"
    title = "Download too large"


# --- checkpoints -------------------------------------------------------------------------------


class CheckpointError(ValueError, ServiceError):
    """The checkpoint's files are unreadable or inconsistent."""

    code = "checkpoint_error"
    title = "Invalid checkpoint"


class CorruptCheckpoint(CheckpointError):
    """Truncated file, header lying about offsets/sizes, malformed JSON."""

    code = "corrupt_checkpoint"
    title = "Corrupt checkpoint"


class UnsafePickle(CheckpointError):
    """A pickle holds something other than tensors; refused by ``weights_only=True``."""

    code = "unsafe_pickle"
    title = "Unsafe pickle"


class MissingShard(CheckpointError):
    code = "missing_shard"
    title = "Missing shard"


class UnsupportedQuantization(CheckpointError):
    """The checkpoint is quantized in a way the readers do not implement (GPTQ/AWQ packed int4,
    bitsandbytes, compressed-tensors, float8 without its scales...): refused, naming the method,
    rather than read as if its packed codes were weights (``service.checkpoint.quantization``
    lists what is read)."""

    code = "unsupported_quantization"
    title = "Unsupported quantization"

    def __init__(self, message: str, method: str | None = None) -> None:
        super().__init__(message)
        self.method = method
        """The ``quant_method`` refused (None when config.json declares none)."""


class NoModelConfig(CheckpointError):
    """A module is needed (verification, graph export) but there is no usable config.json."""

    code = "no_model_config"
    title = "No usable model config"


# --- execution ---------------------------------------------------------------------------------


class JobFailed(ServiceError):
    code = "job_failed"
    title = "Job failed"


class JobCancelled(JobFailed):
    code = "job_cancelled"
    title = "Job cancelled"


class JobTimeout(JobFailed):
    """The job ran longer than its ``timeout`` (or ``MODELPREP_JOB_TIMEOUT``) and was killed."""

    code = "job_timeout"
    title = "Job timed out"


class WorkerCrashed(JobFailed):
    """The job's process died without reporting (signal, OOM kill)."""

    code = "worker_crashed"
    title = "Job process crashed"


class MemoryBudgetExceeded(MemoryError, JobFailed):
    """The job's process group (the job and every child it started) needed more than its
    memory budget (``MODELPREP_JOB_MEMORY``) and was stopped before it could push the service
    into the container's OOM killer or reclaim."""

    code = "memory_budget_exceeded"
    title = "Job memory budget exceeded"


class JobInterrupted(JobFailed):
    """The service stopped while the job ran and it could not be retried."""

    code = "job_interrupted"
    title = "Job interrupted"


class OffloadQuotaExceeded(JobFailed):
    code = "offload_quota_exceeded"
    title = "Offload quota exceeded"


class DiskFull(OSError, JobFailed):
    code = "disk_full"
    title = "Disk full"


class PublishFailed(ConnectionError, JobFailed):
    """Uploading a job's artifacts to the artifact store failed (the store stopped answering,
    retries spent); no manifest was written, so nothing was published."""

    code = "publish_failed"
    title = "Publishing the artifacts failed"


class ExportFailed(JobFailed):
    code = "export_failed"
    title = "Export failed"


class ToolMissing(JobFailed):
    """A program the service runs (a llama.cpp tool) is not installed where it is looked for:
    a deployment fault, reported with how to install it rather than as an internal error."""

    code = "tool_missing"
    title = "Tool missing"


class VerificationFailed(JobFailed):
    code = "verification_failed"
    title = "Verification failed"


class VerificationInconclusive(VerificationFailed):
    """A check could not compare what it must (a near tie followed by a continuation the
    consumer cannot be fed): no evidence either way. A check that has another probe input
    tries it; when none is conclusive the job fails."""

    code = "verification_inconclusive"
    title = "The check could not compare the artifact with its reference"


class QualityBelowThreshold(VerificationFailed):
    """A lossy artifact is correct (it is what was meant to be written) but costs more than the
    request allows: a quality figure against the float source (KL, p99 KL, top-1, top-1 on
    decided positions, perplexity ratio) beyond the export's ``"verify"`` thresholds."""

    code = "quality_below_threshold"
    title = "Quality below the requested threshold"


class ReferenceUnavailable(VerificationFailed):
    """transformers (or PEFT) could not load the source as the job's independent reference. The
    job's own reader may still name the input's fault more precisely (a shape the config does not
    fit is ``weights_mismatch``): the pipeline lets it speak first."""

    code = "reference_unavailable"
    title = "The independent reference cannot load the source"


class VerificationTooLarge(VerificationFailed):
    """The verifying runtime would need more RAM than this worker may give it."""

    code = "verification_too_large"
    title = "Verification needs more memory than allowed"


class WeightsMismatch(CheckpointError):
    """The checkpoint lacks weights the model needs (a module cannot run without them)."""

    code = "weights_mismatch"
    title = "Checkpoint does not match the model"


class ConfigMismatch(WeightsMismatch):
    """config.json promises layers or dimensions the weights do not have (4000 layers on a
    30-layer checkpoint): refused before the model is built, naming the key and the tensor."""

    code = "config_mismatch"
    title = "config.json and the weights disagree"


class AdapterError(CheckpointError):
    """The job's ``adapter`` cannot be applied to its source."""

    code = "adapter_error"
    title = "Invalid adapter"


class UnsupportedAdapter(AdapterError):
    """The adapter is no PEFT LoRA adapter, or one that cannot be merged exactly (DoRA, LoRA on
    embeddings, ``modules_to_save`` copies, a target tied to another weight)."""

    code = "unsupported_adapter"
    title = "Unsupported adapter"


class AdapterMismatch(AdapterError):
    """The adapter was trained on another base: a module it targets is missing from the source,
    or its ``lora_B @ lora_A`` has another shape than the source's weight. The detail names the
    first such module."""

    code = "adapter_mismatch"
    title = "Adapter does not match the source"


class UnmergedAdapterUnsupported(AdapterError):
    """``"merge": false`` keeps the adapter apart, and an export that can only write weights
    (safetensors, NNEF, ONNX, a GGUF without ``"lora": true``) cannot take it: refused at
    submission, naming the export."""

    code = "unmerged_adapter_unsupported"
    title = "Export cannot take an unmerged adapter"


# --- access control and tenants ------------------------------------------------------------------


class Forbidden(PermissionError, ServiceError):
    """The caller is known but may not do this (a tenant key on an admin-only endpoint)."""

    code = "forbidden"
    title = "Forbidden"


class TenantLimitExceeded(QueueFull):
    """A tenant reached one of its limits (active jobs, queued jobs, artifact bytes).

    A ``QueueFull`` so it is answered like back-pressure: ``429`` with ``Retry-After``."""

    code = "tenant_limit_exceeded"
    title = "Tenant limit exceeded"


class ConfigurationError(ValueError, ServiceError):
    """The settings are unusable or unsafe (API keys file unreadable, open service on a
    non-loopback address); raised at start-up, never while serving."""

    code = "configuration_error"
    title = "Invalid configuration"


# --- the client (service.client) -----------------------------------------------------------------


class ClientError(ServiceError):
    """Raised by :class:`service.client.ModelprepClient`; never by the service itself."""

    code = "client_error"
    title = "Client error"


class ApiError(ClientError):
    """The service answered with a problem+json error; ``problem`` is its body."""

    code = "api_error"

    def __init__(self, message: str, http_status: int, problem: dict[str, object]) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.problem = problem


class ServiceUnreachable(ConnectionError, ClientError):
    """No answer from the service (connection refused, timeout, broken stream)."""

    code = "service_unreachable"
    title = "Service unreachable"


class ArtifactsDeleted(ClientError):
    """The job succeeded but its files were removed (``DELETE``, retention): nothing to fetch."""

    code = "artifacts_deleted"
    title = "Artifacts deleted"


class ArtifactCorrupt(ClientError):
    """A downloaded artifact's size or sha256 differs from the job's artifact list."""

    code = "artifact_corrupt"
    title = "Downloaded artifact is corrupt"


# --- distributed execution -----------------------------------------------------------------------


class SecretNotForwardable(InvalidRequest):
    """A per-job secret cannot reach a remote worker without being written to the database;
    workers use their own ``MODELPREP_HF_TOKEN`` instead."""

    code = "secret_not_forwardable"
    title = "Per-job secret not supported by this executor"


class WorkerStopped(JobFailed):
    """The worker running the job shut down; the job goes back to the queue for another one."""

    code = "worker_stopped"
    title = "Worker stopped"
