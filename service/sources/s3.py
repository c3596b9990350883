"""``s3://<bucket>/<prefix>`` sources: a checkpoint directory or one weights file in a bucket.

A prefix with objects directly under it is a checkpoint directory: the files a job needs are
chosen from its listing exactly as for the Hub (:func:`service.sources.hub.plan_files`:
config, tokenizer and generation files, and ONE weight format, the shards an index names when
sharded). Deeper keys are not part of it, and every name must be a plain file name, so no key
(``../`` or otherwise) can land outside the prefix or outside the job's directory. A prefix
that is itself an object is a single weights file, taken with the config and tokenizer
objects beside it.

Identity: the objects' names with their version ids (versioned buckets) or ETags, hashed:
``s3:<endpoint>/<bucket>/<prefix>@<hex>``. The listing gives it before any byte is read, and
every read is conditional on it (``If-Match``), so a job reads exactly the objects its
identity names, or fails with ``checksum_mismatch`` when one changes under it. Files land in
the shared :class:`~service.sources.cache.DownloadCache` under that hash.

Reads are streamed to ``.<name>.part`` files and resumed with a ranged read from the part's end
after a cut connection (retried with :mod:`service.retry`'s backoff while they progress); the
size limit is checked before the first byte. Credentials and errors: :mod:`service.objectstore`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import obstore
from obstore.store import S3Store

from service.checkpoint import AUX_PATTERNS
from service.checkpoint.headers import (
    CheckpointHeaders,
    Format,
    TensorHeader,
    config_of,
    read_file_header,
)
from service.config import Settings
from service.errors import (
    ChecksumMismatch,
    DownloadTooLarge,
    InvalidRequest,
    ObjectNotFound,
    SourceUnreachable,
)
from service.objectstore import (
    S3Location,
    call,
    check_egress,
    classify,
    endpoint_of,
    list_dir,
    store_for,
)
from service.retry import Backoff
from service.sources.base import ResolvedSource, SourceIdentity, SourceRequest
from service.sources.cache import DownloadCache
from service.sources.http import BLOCK_BYTES, PartWriter
from service.sources.hub import plan_files, shards_in, shards_of
from service.stage import JobContext, Phase

if TYPE_CHECKING:
    from obstore import GetOptions, ObjectMeta

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""What a single-object source may be."""


@dataclass(frozen=True)
class S3Object:
    name: str
    """The file name in the checkpoint directory (the key's last segment)."""
    key: str
    size: int
    etag: str | None
    version: str | None

    @property
    def tag(self) -> str:
        """What names these exact bytes: the version id, else the ETag."""
        return f"v:{self.version}" if self.version else f"e:{self.etag or ''}"

    def options(self) -> GetOptions:
        """A read of exactly these bytes (fails if the object was replaced)."""
        if self.version:
            return {"version": self.version}
        return {"if_match": self.etag} if self.etag else {}


@dataclass(frozen=True)
class Listing:
    """What a source location holds: the candidate files of the checkpoint, by name."""

    location: S3Location
    single: str | None
    """The weights file's name when the location is one object."""
    objects: dict[str, S3Object]

    def digest(self) -> str:
        lines = [f"{o.name}\t{o.size}\t{o.tag}" for o in sorted(self.objects.values(),
                                                                    key=lambda o: o.name)]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _object(meta: ObjectMeta) -> S3Object:
    key = str(meta["path"])
    return S3Object(key.rpartition("/")[2], key, int(meta["size"]), meta.get("e_tag"),
                    meta.get("version"))


def _plain(name: str) -> bool:
    """A file name a checkpoint directory may hold: no separator, no dot-dot, not hidden."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def list_source(store: S3Store, location: S3Location, settings: Settings) -> Listing:
    """The objects directly under the prefix, or the single object it names plus the
    config and tokenizer beside it; ObjectNotFound when there is neither."""
    objects = [_object(m) for m in list_dir(store, location, settings)]
    usable = {o.name: o for o in objects if _plain(o.name)}
    if usable:
        return Listing(location, None, usable)
    if not location.prefix or not location.name.endswith(WEIGHT_SUFFIXES):
        raise ObjectNotFound(f"no objects under {location.uri}")
    head = call(lambda: obstore.head(store, location.prefix), location.uri, settings)
    weights = _object(head)
    beside = [_object(m) for m in list_dir(store, location.parent(), settings)]
    aux = {
        o.name: o for o in beside
        if _plain(o.name) and any(fnmatch.fnmatchcase(o.name, p) for p in AUX_PATTERNS)
    }  # fmt: skip
    return Listing(location, weights.name, {**aux, weights.name: weights})


def cache_key(settings: Settings, digest: str) -> str:
    """The download-cache entry of the objects whose listing hashes to ``digest``."""
    endpoint_id = hashlib.sha256(endpoint_of(settings).encode()).hexdigest()[:8]
    return f"s3--{endpoint_id}--{digest[:40]}"


def download_object(
    store: S3Store, obj: S3Object, dest: Path, settings: Settings, ctx: JobContext | None,
) -> int:
    """Stream one object to ``dest`` through ``.<name>.part``, resuming after a cut; returns
    the bytes received over the network. Progress goes to ``ctx`` when given."""
    part = dest.with_name(f".{dest.name}.part")
    backoff = Backoff(settings.download_retries, settings.download_backoff_seconds)
    received = 0
    what = f"s3 object {obj.key}"
    while True:
        have = part.stat().st_size if part.exists() else 0
        if have > obj.size:
            part.unlink()
            have = 0
        if have == obj.size:
            break
        options = obj.options()
        if have:
            options["range"] = {"offset": have}
        progressed = False
        try:
            result = obstore.get(store, obj.key, options=options)
            with PartWriter(part, None) as out:
                for chunk in result.stream(min_chunk_size=BLOCK_BYTES):
                    out.feed(chunk)
                    received += len(chunk)
                    progressed = True
                    if out.pending >= BLOCK_BYTES:
                        if ctx is not None:
                            ctx.advance(out.pending)
                            ctx.check_abort()
                        out.hand_off()
                if ctx is not None:
                    ctx.advance(out.pending)
        except Exception as exc:  # classified: typed errors raise, transient ones retry
            mapped = classify(exc, what)
            if mapped is not None:
                if isinstance(mapped, ChecksumMismatch):
                    part.unlink(missing_ok=True)
                if mapped is exc:
                    raise
                raise mapped from exc
            if not backoff.failed(progressed=progressed):
                raise SourceUnreachable(
                    f"reading {what} from {endpoint_of(settings)} failed after "
                    f"{backoff.failures} attempts"
                ) from exc
    os.replace(part, dest)
    return received


def _chosen(listing: Listing) -> tuple[Format, list[str], str | None, list[str]]:
    """(format, aux files, index, weight files) of a listing, as a job downloads them (the
    weights not yet narrowed to the index's shards)."""
    if listing.single is not None:
        aux = sorted(n for n in listing.objects if n != listing.single)
        fmt: Format = "safetensors" if listing.single.endswith(".safetensors") else "pickle"
        return fmt, aux, None, [listing.single]
    plan = plan_files(list(listing.objects))
    return plan.format, plan.aux, plan.index, plan.weights


class S3Fetcher:
    schemes: tuple[str, ...] = ("s3",)

    def headers(self, request: SourceRequest, settings: Settings) -> CheckpointHeaders:
        """The files a job would download, sized from the listing, each safetensors shard's
        header read with two ranged GETs (never the data), and config.json."""
        store, listing = self._listing(request, settings)
        fmt, aux, index, weights = _chosen(listing)
        objects = listing.objects

        def small(name: str) -> bytes:
            obj = objects[name]
            return bytes(call(lambda: obstore.get(store, obj.key, options=obj.options()).bytes(),
                              f"{listing.location.uri}/{name}", settings))

        if index is not None:
            weights = shards_in(small(index), index, list(objects))
        tensors: list[TensorHeader] = []
        if fmt == "safetensors":
            for name in weights:
                obj = objects[name]

                def read(offset: int, length: int, obj: S3Object = obj) -> bytes:
                    if offset >= obj.size or length <= 0:
                        return b""
                    end = min(obj.size, offset + length)
                    return bytes(call(lambda: obstore.get_range(store, obj.key, start=offset,
                                                                end=end),
                                      obj.key, settings))

                tensors.extend(read_file_header(read, name))
        config = config_of(small("config.json")) if "config.json" in aux else None
        chosen = [*aux, *([index] if index else []), *weights]
        return CheckpointHeaders(fmt, {n: objects[n].size for n in chosen}, tuple(tensors),
                                 config, tuple(weights), remote=True)

    def check(self, request: SourceRequest, settings: Settings) -> None:
        S3Location.parse(request.uri)
        if request.revision is not None:
            raise InvalidRequest("an s3:// source has no revision: name the prefix to read")
        if request.sha256 is not None:
            raise InvalidRequest("an s3:// source is identified by its objects' ETags; "
                                 "sha256 applies to http(s) sources")
        settings.egress_policy.check_literal(endpoint_of(settings))

    def _listing(self, request: SourceRequest, settings: Settings) -> tuple[S3Store, Listing]:
        location = S3Location.parse(request.uri)
        check_egress(settings)
        store = store_for(location.bucket, settings, request.tenant)
        return store, list_source(store, location, settings)

    def identify(
        self,
        request: SourceRequest,
        settings: Settings,
        ctx: JobContext,
        fetched: ResolvedSource | None = None,
    ) -> SourceIdentity:
        """``s3:<endpoint>/<bucket>/<prefix>@<hash of names and ETags/versions>``, from one
        listing; the returned request is pinned to that hash."""
        location = S3Location.parse(request.uri)
        if fetched is not None and fetched.revision:
            digest = fetched.revision
        else:
            ctx.set_phase(Phase.DOWNLOAD, None, "bytes")
            digest = request.pinned or self._listing(request, settings)[1].digest()
        return SourceIdentity(
            f"s3:{endpoint_of(settings)}/{location.bucket}/{location.prefix}@{digest}",
            dataclasses.replace(request, pinned=digest),
        )

    def fetch(self, request: SourceRequest, settings: Settings, ctx: JobContext) -> ResolvedSource:
        ctx.set_phase(Phase.DOWNLOAD, None, "bytes")
        store, listing = self._listing(request, settings)
        digest = listing.digest()
        if request.pinned is not None and request.pinned != digest:
            raise ChecksumMismatch(
                f"the objects under {listing.location.uri} changed since the job resolved them"
            )
        objects = listing.objects
        fmt, aux, index, weights = _chosen(listing)
        expected = sum(objects[n].size for n in [*aux, *weights, *([index] if index else [])])
        if expected > settings.max_download_bytes:
            raise DownloadTooLarge(
                f"{listing.location.uri} holds {expected} bytes of {fmt} files, more than the "
                f"{settings.max_download_bytes} allowed"
            )

        def fill(files: Path) -> int:
            received = 0
            for name in [*aux, *([index] if index else [])]:
                ctx.check_abort()
                if not (files / name).exists():
                    received += download_object(store, objects[name], files / name, settings,
                                                None)
            chosen = shards_of(files / index, list(objects)) if index else weights
            ctx.set_phase(Phase.DOWNLOAD, sum(objects[n].size for n in chosen), "bytes")
            for name in chosen:
                ctx.check_abort()
                if (files / name).exists():
                    ctx.advance(objects[name].size)
                    continue
                received += download_object(store, objects[name], files / name, settings, ctx)
            return received

        entry = DownloadCache.from_settings(settings).acquire(
            cache_key(settings, digest), fill, expected_bytes=expected,
            source={"uri": listing.location.uri, "digest": digest},
        )
        files = sorted(p.name for p in entry.path.iterdir() if not p.name.startswith("."))
        path = entry.path / listing.single if listing.single is not None else entry.path
        ctx.set_metric("cache_hit", entry.hit)
        ctx.add_metric("bytes_downloaded", entry.bytes_downloaded)
        etags: dict[str, Any] = {n: objects[n].tag for n in files if n in objects}
        ctx.set_detail("source", {
            "uri": listing.location.uri,
            "endpoint": endpoint_of(settings),
            "digest": digest,
            "format": fmt,
            "files": files,
            "objects": etags,
            "cache_hit": entry.hit,
        })
        return ResolvedSource(path=path, uri=listing.location.uri, revision=digest,
                              cache_hit=entry.hit, bytes_downloaded=entry.bytes_downloaded)

