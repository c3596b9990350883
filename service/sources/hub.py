"""``hf://<org>/<repo>`` sources: the files a job needs from one commit of a Hugging Face repo.

Everything goes through ``huggingface_hub`` against ``settings.hf_endpoint``. The revision
(branch, tag or commit; ``main`` by default) is resolved to a commit sha first, with the job's
token: that call is also what authorizes a job to use a cached copy of a gated or private repo,
so it is made on cache hits too. Only the files a job needs are fetched, selected from the
commit's file listing with the Hub's own pattern matching (``filter_repo_objects``, what
``snapshot_download(allow_patterns=...)`` uses): config, tokenizer and generation config files,
and ONE weight format (safetensors when present, else ``.bin``/``.pt``), the shards named by the
index when sharded. Files land in the shared :class:`~service.sources.cache.DownloadCache`
under the commit, so two jobs of one repo and commit download it once.

The token (per job, else ``settings.hf_token``: ``MODELPREP_HF_TOKEN``, else ``HF_TOKEN``) is
passed to ``huggingface_hub`` and nowhere else: it is not logged, not put in messages, details
or the ResolvedSource. The endpoint is ``MODELPREP_HF_ENDPOINT``, else ``HF_ENDPOINT``; under
``HF_HUB_OFFLINE`` hub sources are refused (``source_not_allowed``). huggingface_hub's shared
client, which downloads Xet files too (not hf_xet), goes through the settings' proxy and trusts
their CA bundle (:func:`_hub_network`); the
hub endpoint is the operator's choice, so the egress policy does not judge it or its redirects.
A failure names the endpoint, the variable it came from and the proxy it went through.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from huggingface_hub import HfApi, get_session, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from pydantic import SecretStr

from service.checkpoint import AUX_PATTERNS
from service.checkpoint.headers import CheckpointHeaders, TensorHeader, config_of
from service.config import Settings
from service.egress import Proxy, untrusted_certificate
from service.errors import (
    DiskFull,
    DownloadFailed,
    DownloadTooLarge,
    InvalidRequest,
    NoWeightFiles,
    RepositoryNotFound,
    RevisionNotFound,
    ServiceError,
    SourceNotAllowed,
    SourceNotFound,
    SourceUnauthorized,
)
from service.retry import Backoff
from service.shims.huggingface_hub import (
    TransportError,
    build_hf_headers,
    client_factory,
    filter_repo_objects,
    job_progress_bar,
    keep_downloads_on_client,
    set_client_factory,
    validate_repo_id,
)
from service.sources.base import ResolvedSource, SourceIdentity, SourceRequest
from service.sources.cache import DownloadCache
from service.sources.http import remote_header
from service.stage import JobContext, Phase

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"

SAFETENSORS_PATTERNS = ["*.safetensors"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]
PICKLE_NOT_WEIGHTS = ["training_args.bin", "optimizer.*", "scheduler.*", "rng_state*", "*.index.json"]
"""Trainer state saved next to checkpoints with weight-like extensions."""

_URI = re.compile(r"^hf://(?P<repo_id>[^/?#@]+/[^/?#@]+)/?$")
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}$")
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

T = TypeVar("T")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str


@dataclass(frozen=True)
class FilePlan:
    """Which files of a commit a job downloads."""

    format: Literal["safetensors", "pickle"]
    aux: list[str]
    index: str | None
    weights: list[str]
    """Every top-level file of the format; narrowed to the index's shards once it is read."""


def parse_hf_uri(uri: str, revision: str | None) -> HubRef:
    """``hf://org/repo`` + optional revision -> HubRef; raises InvalidRequest when malformed."""
    match = _URI.match(uri)
    if match is None:
        raise InvalidRequest(f"malformed Hugging Face source {uri!r}; expected hf://<org>/<repo>")
    repo_id = match.group("repo_id")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise InvalidRequest(f"malformed Hugging Face repo id {repo_id!r}") from exc
    rev = DEFAULT_REVISION if revision is None else revision
    if not _REVISION.match(rev) or ".." in rev or rev.endswith(("/", ".lock")):
        raise InvalidRequest(f"malformed revision {rev!r}")
    return HubRef(repo_id, rev)


def plan_files(repo_files: list[str]) -> FilePlan:
    """Pick the job's files from a commit's listing (top level only); raises NoWeightFiles."""
    top = [f for f in repo_files if "/" not in f]
    aux = sorted(filter_repo_objects(top, allow_patterns=list(AUX_PATTERNS)))
    safetensors = sorted(filter_repo_objects(top, allow_patterns=SAFETENSORS_PATTERNS))
    if safetensors:
        return FilePlan("safetensors", aux, _index_of(top, ".safetensors", "model"),
                        _prefer(safetensors, "model.safetensors"))
    pickles = sorted(filter_repo_objects(
        top, allow_patterns=PICKLE_PATTERNS, ignore_patterns=PICKLE_NOT_WEIGHTS
    ))
    if pickles:
        return FilePlan("pickle", aux, _index_of(top, ".bin", "pytorch_model"),
                        _prefer(pickles, "pytorch_model.bin"))
    raise NoWeightFiles("the repository has no .safetensors, .bin or .pt weight files")


def _index_of(top: list[str], suffix: str, stem: str) -> str | None:
    indexes = sorted(f for f in top if f.endswith(f"{suffix}.index.json"))
    preferred = f"{stem}{suffix}.index.json"
    return preferred if preferred in indexes else (indexes[0] if indexes else None)


def _prefer(files: list[str], single: str) -> list[str]:
    """A repo with both a single-file and other variants (fp16 copies, consolidated files):
    the canonical single file is the checkpoint."""
    return [single] if single in files else files


def shards_of(index_file: Path, available: list[str]) -> list[str]:
    """The shard files an index names; each must be a top-level file of the commit."""
    return shards_in(index_file.read_bytes(), index_file.name, available)


def shards_in(raw: bytes, index_name: str, available: list[str]) -> list[str]:
    """:func:`shards_of` for the index's bytes."""
    index_file = Path(index_name)
    try:
        weight_map = json.loads(raw)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NoWeightFiles(f"unreadable weight index {index_file.name}") from exc
    missing = [s for s in shards if not isinstance(s, str) or "/" in s or s not in available]
    if missing or not shards:
        raise NoWeightFiles(f"weight index {index_file.name} names shards not in the repository")
    return shards


def _secret(request: SourceRequest, settings: Settings) -> str | Literal[False]:
    token: SecretStr | None = request.token or settings.hf_token
    # False, not None: never fall back to a token found in the environment or ~/.cache.
    return token.get_secret_value() if token is not None else False


def _map_error(exc: Exception, ref: HubRef, settings: Settings) -> ServiceError | None:
    """The typed error for a hub failure, or None when it is worth retrying."""
    what = f"{ref.repo_id}@{ref.revision}"
    refused = untrusted_certificate(exc)
    if refused is not None:
        return settings.egress_policy.untrusted(
            f"the hub at {_endpoint(settings)} ({settings.origin('hf_endpoint')})", refused
        )
    if isinstance(exc, GatedRepoError | DisabledRepoError):
        return SourceUnauthorized(f"access to {ref.repo_id} refused (gated or disabled)")
    if isinstance(exc, RevisionNotFoundError):
        return RevisionNotFound(f"revision {ref.revision!r} not found in {ref.repo_id}")
    if isinstance(exc, RepositoryNotFoundError):
        return RepositoryNotFound(
            f"repository {ref.repo_id} not found (or private/gated without a valid token)"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return SourceNotFound(f"a file of {what} vanished from the hub")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return SourceUnauthorized(f"the hub refused access to {ref.repo_id} (HTTP {status})")
        if status in _TRANSIENT_STATUS:
            return None
        return DownloadFailed(f"the hub answered HTTP {status} for {what}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DiskFull(f"disk full while downloading {what}")
    if isinstance(exc, TransportError | LocalEntryNotFoundError | OSError):
        return None
    return DownloadFailed(f"fetching {what} failed: {type(exc).__name__}")


def _map_error_status(status: int, ref: HubRef) -> ServiceError:
    """The typed error of a hub file request answered ``status``."""
    if status in (401, 403):
        return SourceUnauthorized(f"the hub refused access to {ref.repo_id} (HTTP {status})")
    if status == 404:
        return SourceNotFound(f"a file of {ref.repo_id}@{ref.revision} is not on the hub")
    return DownloadFailed(f"the hub answered HTTP {status} for {ref.repo_id}@{ref.revision}")


def _with_retries(call: Callable[[], T], ref: HubRef, settings: Settings) -> T:
    """Run a hub call, retrying network failures with exponential backoff."""
    backoff = Backoff(settings.download_retries, settings.download_backoff_seconds)
    while True:
        try:
            return call()
        except ServiceError:
            raise
        except Exception as exc:  # every failure is mapped below, none is swallowed
            mapped = _map_error(exc, ref, settings)
            if mapped is not None:
                raise mapped from exc
            if not backoff.failed():
                raise DownloadFailed(
                    f"fetching {ref.repo_id}@{ref.revision} from the hub at {_endpoint(settings)} "
                    f"({settings.origin('hf_endpoint')}{_through(settings)}) failed after "
                    f"{backoff.failures} attempts: {type(exc).__name__}"
                ) from exc


def _endpoint(settings: Settings) -> str:
    return (settings.hf_endpoint or DEFAULT_ENDPOINT).rstrip("/")


def _through(settings: Settings) -> str:
    """``; through the proxy ...`` when hub requests go through one, for a message."""
    parts = urlsplit(_endpoint(settings))
    proxy = settings.proxy_routes.for_target(parts.scheme, parts.hostname or "")
    return f"; through {settings.proxy_routes.describe(proxy)}" if proxy else ""


_network_lock = threading.Lock()
_network: list[tuple[Proxy, Path | None]] = []
"""The proxy and CA bundle huggingface_hub's shared client was last built with."""


def _hub_network(settings: Settings) -> str:
    """The hub endpoint, once huggingface_hub's shared client goes through the settings' proxy
    and trusts their CA bundle (rebuilt only when those change). Raises SourceNotAllowed under
    ``HF_HUB_OFFLINE``."""
    if settings.hf_hub_offline:
        raise SourceNotAllowed("hf:// sources are refused: HF_HUB_OFFLINE is set on the service")
    wanted = (settings.proxy_routes, settings.ca_bundle)
    with _network_lock:
        if _network[-1:] != [wanted]:
            policy = settings.egress_policy
            set_client_factory(client_factory(policy.proxy.for_target, policy.ssl_context()))
            keep_downloads_on_client()
            _network[:] = [wanted]
    return _endpoint(settings)


def _resolve_commit(api: HfApi, ref: HubRef, settings: Settings) -> str:
    """The commit sha ``ref.revision`` (branch, tag or sha) names now; with the job's token,
    which is what authorizes a job to use a cached copy of a gated repo."""
    info = _with_retries(lambda: api.model_info(ref.repo_id, revision=ref.revision), ref,
                         settings)
    if info.sha is None:
        raise RevisionNotFound(f"revision {ref.revision!r} of {ref.repo_id} has no commit")
    return info.sha


def _file_sizes(api: HfApi, ref: HubRef, settings: Settings) -> dict[str, int]:
    """The files of the repository at ``ref``'s revision (a commit) and their sizes: one
    recursive listing, retried."""
    tree = _with_retries(
        lambda: [e for e in api.list_repo_tree(ref.repo_id, revision=ref.revision, recursive=True)
                 if isinstance(e, RepoFile)],
        ref, settings,
    )
    return {e.path: e.size for e in tree}


def _shard_header(
    session: Any, url: str, name: str, auth: dict[str, str]
) -> list[TensorHeader]:
    _, header = remote_header(session, url, name, auth)
    assert header is not None  # a .safetensors name
    return header.tensors()


class HubFetcher:
    schemes: tuple[str, ...] = ("hf",)

    def check(self, request: SourceRequest, settings: Settings) -> None:
        parse_hf_uri(request.uri, request.revision)
        if settings.hf_hub_offline:
            _hub_network(settings)  # raises, naming HF_HUB_OFFLINE

    def identify(
        self,
        request: SourceRequest,
        settings: Settings,
        ctx: JobContext,
        fetched: ResolvedSource | None = None,
    ) -> SourceIdentity:
        """``hf:<endpoint>/<repo>@<commit>``: one API call resolves a branch or tag, before
        any file is downloaded; the returned request is pinned to that commit."""
        ref = parse_hf_uri(request.uri, request.revision)
        endpoint = _hub_network(settings)
        if fetched is not None and fetched.revision:
            commit = fetched.revision
        else:
            ctx.set_phase(Phase.DOWNLOAD, None, "bytes")
            api = HfApi(endpoint=endpoint, token=_secret(request, settings))
            commit = request.pinned or _resolve_commit(api, ref, settings)
        return SourceIdentity(
            f"hf:{endpoint}/{ref.repo_id}@{commit}", dataclasses.replace(request, pinned=commit)
        )

    def headers(self, request: SourceRequest, settings: Settings) -> CheckpointHeaders:
        """One commit's files as a job would download them (the same choice of files), sized
        from the commit's listing, with each safetensors shard's header read by range reads
        that stop after it, and config.json.

        Why not ``HfApi.parse_safetensors_file_metadata``: it reads ``response.content`` of
        its range request, which from a server that ignores ``Range`` (olah's mirror, some
        proxies) is the whole shard; here the body is cut off after the header."""
        ref = parse_hf_uri(request.uri, request.revision)
        endpoint = _hub_network(settings)
        token = _secret(request, settings)
        api = HfApi(endpoint=endpoint, token=token)
        commit = request.pinned or _resolve_commit(api, ref, settings)
        at_commit = HubRef(ref.repo_id, commit)
        sizes = _file_sizes(api, at_commit, settings)
        plan = plan_files(list(sizes))
        auth = build_hf_headers(token=token)
        session = get_session()

        def small(name: str) -> bytes:
            url = hf_hub_url(ref.repo_id, name, revision=commit, endpoint=endpoint)
            response = session.get(url, headers=auth, timeout=30.0)
            if response.status_code >= 400:
                raise _map_error_status(response.status_code, at_commit)
            return bytes(response.content)

        weights = plan.weights
        if plan.index is not None:
            index = plan.index
            weights = _with_retries(lambda: shards_in(small(index), index, list(sizes)),
                                    at_commit, settings)
        tensors: list[TensorHeader] = []
        if plan.format == "safetensors":
            for name in weights:
                url = hf_hub_url(ref.repo_id, name, revision=commit, endpoint=endpoint)
                tensors.extend(_with_retries(
                    lambda url=url, name=name: _shard_header(session, url, name, auth),  # type: ignore[misc]
                    at_commit, settings,
                ))
        config = (
            config_of(_with_retries(lambda: small("config.json"), at_commit, settings))
            if "config.json" in plan.aux else None
        )
        chosen = [*plan.aux, *([plan.index] if plan.index else []), *weights]
        return CheckpointHeaders(
            plan.format, {f: sizes.get(f, 0) for f in chosen}, tuple(tensors), config,
            tuple(weights), remote=True,
        )

    def fetch(self, request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
        ref = parse_hf_uri(request.uri, request.revision)
        endpoint = _hub_network(settings)
        token = _secret(request, settings)
        api = HfApi(endpoint=endpoint, token=token)
        ctx.set_phase(Phase.DOWNLOAD, None, "bytes")
        # Pinned by identify() in this job, with this token: that call authorized it.
        commit = request.pinned or _resolve_commit(api, ref, settings)
        at_commit = HubRef(ref.repo_id, commit)
        sizes = _file_sizes(api, at_commit, settings)
        plan = plan_files(list(sizes))
        expected = sum(sizes.get(f, 0) for f in [*plan.aux, *plan.weights])
        if expected > settings.max_download_bytes:  # an upper bound when the index narrows it
            raise DownloadTooLarge(
                f"{ref.repo_id}@{commit} holds {expected} bytes of {plan.format} files, more "
                f"than the {settings.max_download_bytes} allowed"
            )

        def download(name: str, files: Path, progress: JobContext | None) -> int:
            """Fetch one file into the entry; returns the bytes that came over the network."""
            ctx.check_abort()
            if (files / name).exists():
                if progress is not None:
                    progress.advance(sizes.get(name, 0))
                return 0
            _with_retries(lambda: hf_hub_download(
                ref.repo_id, name, revision=commit, endpoint=endpoint, token=token,
                local_dir=files, tqdm_class=job_progress_bar(progress),
            ), at_commit, settings)
            return (files / name).stat().st_size

        def fill(files: Path) -> int:
            received = 0
            for name in [*plan.aux, *([plan.index] if plan.index else [])]:
                received += download(name, files, None)
            weights = shards_of(files / plan.index, list(sizes)) if plan.index else plan.weights
            ctx.set_phase(Phase.DOWNLOAD, sum(sizes.get(w, 0) for w in weights), "bytes")
            for name in weights:
                received += download(name, files, ctx)
            # huggingface_hub's resume metadata; the entry is complete, a job must not see it.
            shutil.rmtree(files / ".cache", ignore_errors=True)
            return received

        endpoint_id = hashlib.sha256(endpoint.encode()).hexdigest()[:8]
        key = f"hub--{ref.repo_id.replace('/', '--')}--{commit}--{endpoint_id}"
        entry = DownloadCache.from_settings(settings).acquire(
            key, fill,
            expected_bytes=expected,
            source={"repo_id": ref.repo_id, "revision": commit, "endpoint": endpoint},
        )
        files = sorted(p.name for p in entry.path.iterdir() if not p.name.startswith("."))
        ctx.set_metric("cache_hit", entry.hit)
        ctx.add_metric("bytes_downloaded", entry.bytes_downloaded)
        ctx.set_detail("source", {
            "uri": request.uri,
            "repo_id": ref.repo_id,
            "requested_revision": ref.revision,
            "revision": commit,
            "format": plan.format,
            "files": files,
            "cache_hit": entry.hit,
        })
        return ResolvedSource(path=entry.path, uri=request.uri, revision=commit,
                              cache_hit=entry.hit, bytes_downloaded=entry.bytes_downloaded)
