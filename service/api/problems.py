"""The catalogue of problem types: what each ``type`` of a problem+json answer (and each
``error.type`` of a failed job) means and how to fix it.

Every problem's ``type`` is ``/problems/<code>``, a page this service serves from this
catalogue (``GET /problems/<code>``; ``GET /problems`` lists them all), and
``docs/errors.md`` is the same catalogue printed by ``modelprep reference errors`` (a test keeps
the two equal). The entries come from the exception tree in ``service.errors`` (code, title,
docstring, HTTP status from ``service.api.errors``) plus the few problems only the HTTP layer
raises; :data:`FIXES` adds the sentence a newcomer needs.
"""

from __future__ import annotations

import html
import inspect
import re
from dataclasses import dataclass

from service import errors as domain

PROBLEMS_PATH = "/problems/"
"""Where the service serves the catalogue; problem ``type`` URIs are this path + the code."""


@dataclass(frozen=True)
class ProblemType:
    """One problem type: its code, title, HTTP status (None: only ever a failed job's
    ``error.type``), what it means and how to fix it."""

    code: str
    title: str
    status: int | None
    meaning: str
    fix: str


FIXES: dict[str, str] = {
    "malformed_json": "Send a valid JSON document (check quotes and commas; `python3 -m "
    "json.tool < body.json` shows where it breaks).",
    "invalid_request": "The `detail` names each field (`exports[0].type`) with the values it "
    "accepts and the closest one to what was sent; the schema at `/docs` describes every field.",
    "unsupported_media_type": "Send the body as JSON with `content-type: application/json` "
    "(curl: `-H 'content-type: application/json'`; without it curl sends a form).",
    "unsupported_dtype": "Pick a dtype the format lists (safetensors: `float32`, `float16`, "
    "`bfloat16`, also spelled `f32`, `f16`, `bf16`).",
    "unsupported_quantization": "The detail names the quantization method (or the tensor "
    "whose dtype says it is quantized). Block-scaled FP8 (`quant_method: fp8`) is read; for "
    "GPTQ, AWQ, bitsandbytes or compressed-tensors, submit the float checkpoint it was made from "
    "(or dequantize it with transformers and save it).",
    "unsupported_export": "Pick a format and options the detail lists; GGUF takes the "
    "architectures llama.cpp's converter knows, in the configurations llama.cpp runs as "
    "transformers does (the detail names the config key it contradicts), ONNX causal LMs and "
    "encoders.",
    "missing_tokenizer": "GGUF types that llama.cpp must run to check or quantize (the K-quants "
    "and IQ4 types such as `Q4_K_M`, or an `imatrix` from calibration text) need a tokenizer "
    "llama.cpp can hold: BPE (`tokenizer.json` with a pre-tokenizer llama.cpp knows), "
    "SentencePiece (`tokenizer.model`) or WordPiece (`vocab.txt`); a word-level vocabulary (the "
    "one of `modelprep demo-model`) cannot be. Add the checkpoint's tokenizer, or skip "
    "llama.cpp's checks with `\"verify\": false` on the GGUF export (without `imatrix`); f32, "
    "f16, bf16, q8_0 and q4_0 need no tokenizer.",
    "unsupported_tokenizer": "llama.cpp does not know the checkpoint's BPE pre-tokenizer: accept "
    "its generic splitting with `\"pre_tokenizer_fallback\": \"default\"` on the GGUF export "
    "(recorded in the manifest), or export another format. Or the family's converter reads a "
    "file the checkpoint lacks (Gemma, Gemma 2, InternLM3 and Phi-3 write their vocabulary from "
    "a SentencePiece `tokenizer.model` only): add the model's own tokenizer file the detail "
    "names.",
    "callback_not_configured": "The operator sets `MODELPREP_CALLBACK_SECRETS` (a tenant's "
    "signing key) or, without API keys, `MODELPREP_CALLBACK_SECRET`; or submit without "
    "`callback`.",
    "secret_not_forwardable": "With workers (`MODELPREP_EXECUTOR=procrastinate`) a per-job "
    "`hf_token` would have to be stored: give the workers `MODELPREP_HF_TOKEN` instead.",
    "not_found": "No such route: check the URL (the API is under `/v1`; `/docs` lists it).",
    "method_not_allowed": "The `Allow` header lists the methods this path takes.",
    "job_not_found": "Check the id (`GET /v1/jobs` lists yours); another tenant's job answers "
    "404 too.",
    "artifact_not_found": "Only a succeeded job has artifacts: wait for it (`modelprep wait "
    "ID`) and download the paths its `artifacts` list names.",
    "artifact_gone": "The job's files were removed (`DELETE` or `MODELPREP_ARTIFACT_TTL`): "
    "submit the job again.",
    "conflict": "The job is not in a state that allows this: `GET` it to see its status.",
    "queue_full": "Retry after the `Retry-After` seconds; the operator can raise "
    "`MODELPREP_MAX_QUEUED`.",
    "tenant_limit_exceeded": "Wait for running jobs, or free artifact bytes with `DELETE`; the "
    "detail names the limit (`MODELPREP_TENANT_MAX_*`).",
    "unauthorized": "Send `Authorization: Bearer <key>` (CLI: `--api-key` or "
    "`MODELPREP_API_KEY`); `modelprep keygen` makes keys.",
    "forbidden": "This needs an admin key (`modelprep keygen --admin`).",
    "path_outside_root": "The path leaves the directory it must stay in; use the paths the "
    "service lists.",
    "source_not_allowed": "A `file://` source must lie under a directory of "
    "`MODELPREP_LOCAL_ROOTS`, a JSON list set by the operator (e.g. "
    "`MODELPREP_LOCAL_ROOTS='[\"/srv/models\"]'`); an `hf://` source needs `HF_HUB_OFFLINE` "
    "unset on the service.",
    "egress_refused": "The host is loopback, private or otherwise not global: the operator "
    "allows an internal mirror or receiver with `MODELPREP_EGRESS_ALLOWLIST`.",
    "source_not_found": "Check the path or URL; a `file://` path must be absolute.",
    "repository_not_found": "Check the repository name (and `MODELPREP_HF_ENDPOINT` or "
    "`HF_ENDPOINT` for a mirror).",
    "revision_not_found": "Check `revision`: a branch, tag or commit of the repository.",
    "source_unreadable": "Make the files readable by the service's user (in the container: "
    "`chmod -R a+rX models`).",
    "source_unauthorized": "Give a token with access: `hf_token` on the job or "
    "`MODELPREP_HF_TOKEN` (or `HF_TOKEN`) on the service.",
    "no_weight_files": "The source has no `.safetensors`, `.bin` or `.pt` weights.",
    "download_failed": "Retries did not get the file: check the source is reachable from the "
    "service, then submit again.",
    "certificate_untrusted": "The server's certificate comes from a CA the service does not "
    "trust: the operator names its bundle in `MODELPREP_CA_BUNDLE` (or `SSL_CERT_FILE`, "
    "`REQUESTS_CA_BUNDLE`; for the object store and STS first `MODELPREP_S3_CA_BUNDLE` or "
    "`AWS_CA_BUNDLE`); a TLS-intercepting proxy's CA included.",
    "download_stalled": "The source sent too little for too long "
    "(`MODELPREP_DOWNLOAD_STALL_SECONDS`, `MODELPREP_DOWNLOAD_MIN_BYTES_PER_SECOND`).",
    "checksum_mismatch": "The file's sha256 is not the `sha256` the job gave: check both.",
    "download_too_large": "The source exceeds `MODELPREP_MAX_DOWNLOAD_BYTES`.",
    "corrupt_checkpoint": "A weights file is truncated or malformed: download it again.",
    "unsafe_pickle": "The pickle holds more than tensors: convert it to safetensors.",
    "missing_shard": "A shard named by the index is absent: copy every shard.",
    "no_model_config": "Add the checkpoint's `config.json`, or export only state-dict formats "
    "(safetensors with `\"verify\": false`).",
    "weights_mismatch": "The weights do not fit the architecture of `config.json`: check both "
    "come from the same model.",
    "config_mismatch": "The detail names the `config.json` key and tensor that disagree.",
    "adapter_error": "Check that `adapter` is a PEFT LoRA adapter trained on `source`.",
    "unsupported_adapter": "Only plain LoRA on linear layers is merged: merge other adapters "
    "with PEFT first.",
    "adapter_mismatch": "The detail names the first module the source lacks or whose shape "
    "differs: pass the adapter's base model as `source`.",
    "unmerged_adapter_unsupported": "With `\"merge\": false` every export must write the "
    "adapter itself (`{\"format\": \"gguf\", \"lora\": true}`); merge it for the others.",
    "job_cancelled": "The job was cancelled (`POST /v1/jobs/{id}/cancel` or `DELETE`).",
    "job_timeout": "The job ran longer than its `timeout` or `MODELPREP_JOB_TIMEOUT`.",
    "worker_crashed": "The job's process died (often the kernel's OOM killer): lower "
    "`max_memory`, or give the service more memory.",
    "job_interrupted": "The service stopped three times while the job ran: submit it again.",
    "worker_stopped": "The worker running the job stopped; another one retries it.",
    "offload_quota_exceeded": "Raise `MODELPREP_OFFLOAD_QUOTA` or give the job more "
    "`max_memory`.",
    "disk_full": "Free disk under `MODELPREP_DATA_DIR` (or shorten `MODELPREP_ARTIFACT_TTL`).",
    "tool_missing": "Build llama.cpp's tools (`make llama-cpp`) or point "
    "`MODELPREP_LLAMA_CPP_DIR` at them.",
    "verification_inconclusive": "The consumer's output parted from the reference at a near "
    "tie on every probe input and could not be fed the reference's continuation (the message "
    'names the step): no evidence either way; `"verify": false` on that export skips the check.',
    "verification_failed": "The export differs from the source beyond the dtype's tolerance: "
    "the manifest holds the errors; try a wider dtype, or `\"verify\": false` to skip.",
    "quality_below_threshold": "The file is what was meant to be written, but its quality "
    "figures against the float source (in the detail, and in a successful job's manifest) are "
    "beyond the export's `verify` thresholds: choose a higher-precision type (q8_0, Q6_K) or "
    "relax the thresholds.",
    "reference_unavailable": "transformers' own `from_pretrained` (the job's independent "
    "reference) cannot load the checkpoint: the message says why; a checkpoint transformers "
    "cannot read is exported only with `\"verify\": false`.",
    "verification_too_large": "Raise `MODELPREP_TRACT_MAX_MEMORY` / `MODELPREP_ORT_MAX_MEMORY` "
    "(or `MODELPREP_JOB_MEMORY`), "
    "or skip the check with `\"verify\": false` on that export.",
    "plan_does_not_fit": "Submit with `\"dry_run\": true` to see the plan: give the service "
    "more memory (`MODELPREP_JOB_MEMORY`, fewer `MODELPREP_WORKERS`) or disk, skip a check "
    "with `\"verify\": false`, or export fewer formats per job.",
    "configuration_error": "The detail names the setting and an example value.",
    "internal_error": "A bug: the service's log has the traceback (search it for the "
    "response's `X-Request-ID`).",
}
"""How to fix each problem, in one or two sentences; a type without one says what it means."""

_HTTP_ONLY = [
    ("malformed_json", "Malformed JSON", 400, "The request body is not valid JSON."),
    ("unsupported_media_type", "Unsupported media type", 415,
     "The body was not sent as JSON (`content-type: application/json`)."),
    ("method_not_allowed", "Method not allowed", 405, "The path does not take this method."),
    ("http_error", "HTTP error", None, "Another HTTP-level refusal; the detail says which."),
    ("internal_error", "Internal error", 500, "An unexpected error in the service."),
    ("offload_store_error", "Offload store error", None,
     "The job's offload store is unusable: corrupt index, unknown tensor, or aborted."),
]


def _meaning(cls: type[domain.ServiceError]) -> str:
    doc = inspect.getdoc(cls)
    if not doc or cls.__doc__ is None or cls.__doc__ is domain.ServiceError.__doc__:
        return cls.title + "."
    return " ".join(doc.split())


def catalogue() -> dict[str, ProblemType]:
    """Every problem type the service answers or fails a job with, by code, sorted."""
    from service.api.errors import HTTP_STATUS, http_status

    found: dict[str, ProblemType] = {}
    pending: list[type[domain.ServiceError]] = [domain.ServiceError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ != domain.__name__ or issubclass(cls, domain.ClientError):
            continue
        if cls is domain.ServiceError:
            continue
        listed = any(base in HTTP_STATUS for base in cls.__mro__)
        status = http_status(cls) if listed else None
        found[cls.code] = ProblemType(
            cls.code, cls.title, status, _meaning(cls), FIXES.get(cls.code, "")
        )
    for code, title, status, meaning in _HTTP_ONLY:
        found[code] = ProblemType(code, title, status, meaning, FIXES.get(code, ""))
    return dict(sorted(found.items()))


def type_uri(code: str) -> str:
    """The ``type`` of a problem with this code: the page that documents it."""
    return PROBLEMS_PATH + code


def markdown() -> str:
    """``docs/errors.md``: the catalogue as one Markdown page."""
    lines = [
        "# Error types",
        "",
        "<!-- Generated by `modelprep reference errors > docs/errors.md`; a test checks it. -->",
        "",
        "Every error the API answers is RFC 9457 `application/problem+json` whose `type` is",
        "`/problems/<code>` on the service itself (open it: the page below, served by the",
        "service); a failed job's `error.type` is the same code. HTTP status: what the API",
        "answers (\"job\" when it only ever fails a job).",
        "",
        "| type | HTTP | what it means | how to fix it |",
        "|---|---|---|---|",
    ]
    for problem in catalogue().values():
        status = str(problem.status) if problem.status else "job"
        meaning = problem.meaning.replace("|", "\\|")
        fix = problem.fix.replace("|", "\\|")
        lines.append(f"| `{problem.code}` | {status} | {meaning} | {fix} |")
    return "\n".join(lines) + "\n"


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>
<body><main>
{body}
</main></body></html>
"""


def _html_text(text: str) -> str:
    """Escaped text with its `code spans` as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text, quote=False))


def html_page(problem: ProblemType) -> str:
    """The page ``GET /problems/<code>`` serves: what the problem means and how to fix it."""
    status = f"HTTP {problem.status}" if problem.status else "a failed job's error.type"
    body = (
        f"<h1>{html.escape(problem.title)} (<code>{html.escape(problem.code)}</code>)</h1>\n"
        f"<p>Answered as: {status}.</p>\n"
        f"<h2>What it means</h2><p>{_html_text(problem.meaning)}</p>\n"
    )
    if problem.fix:
        body += f"<h2>How to fix it</h2><p>{_html_text(problem.fix)}</p>\n"
    body += '<p><a href="/problems">Every error type</a></p>'
    return _PAGE.format(title=html.escape(f"modelprep: {problem.code}"), body=body)


def html_index() -> str:
    """``GET /problems``: every problem type, each linking to its page."""
    items = "\n".join(
        f'<li><a href="{type_uri(p.code)}"><code>{html.escape(p.code)}</code></a>: '
        f"{html.escape(p.title)}</li>"
        for p in catalogue().values()
    )
    return _PAGE.format(title="modelprep: error types",
                        body=f"<h1>Error types</h1>\n<ul>\n{items}\n</ul>")
