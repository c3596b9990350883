"""The artifact store: a job's finished files and manifest published to an S3 bucket.

With ``MODELPREP_ARTIFACT_STORE=s3://bucket/prefix`` a job's artifacts go to
``<prefix>/<tenant>/<job id>/`` (``_`` for the tenant in open mode), or under a per-job
``"destination"`` the tenant is granted (``MODELPREP_ARTIFACT_DESTINATIONS``). Layout::

    <location>/<file>...        every artifact, relative paths as in the job's staging dir
    <location>/manifest.json    written LAST: its presence is the publication

Uploads stream from the staging directory (never whole files in memory): multipart above
``PART_BYTES``, up to ``PART_CONCURRENCY`` parts in flight, each part sent with its SHA-256
(``x-amz-checksum-sha256``: the server refuses a part whose bytes do not match), and the
file's own sha256 computed on the way is checked against the manifest's before the manifest is
written. A reader that finds ``manifest.json`` therefore finds every file it lists, complete;
a job that fails mid-upload (the store stopped, a part refused, the job cancelled) leaves no
manifest, removes what it uploaded and aborts its multipart uploads still in progress
(``obstore.put`` does not: their stored parts would stay on the server, billed and unlisted).
An abort the store cannot take then (it is stopped) is done by the job's next attempt (publish
first aborts what is in progress under the job's location) or the removal of its set, or left
to the sweep of orphaned uploads (:meth:`ArtifactStore.abort_orphaned_uploads`, which the API
runs at start and with retention: uploads in progress longer than
``MODELPREP_ARTIFACT_UPLOAD_ORPHAN_AFTER``), or the bucket's AbortIncompleteMultipartUpload
lifecycle rule (the only cleanup when the service signs with instance credentials, which it
cannot use for these requests). Removal (DELETE, retention) deletes the manifest FIRST, so a
half-removed set is never mistaken for a published one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import obstore
from obstore.store import S3Store

from service.config import Settings
from service.errors import (
    CertificateUntrusted,
    ChecksumMismatch,
    Forbidden,
    ObjectNotFound,
    PublishFailed,
    ServiceError,
)
from service.objectstore import (
    COPY_OBJECT_MAX_BYTES,
    MultipartCopy,
    S3Location,
    abort_uploads,
    call,
    presign_seconds,
    public_endpoint_of,
    store_for,
)
from service.stage import JobContext

if TYPE_CHECKING:
    from obstore import ObjectMeta

MANIFEST = "manifest.json"
PART_BYTES = 16 * 1024 * 1024
"""Multipart part size: S3's minimum is 5 MiB; 16 MiB keeps a 100 GB file under 10,000 parts."""
PART_CONCURRENCY = 4
READ_BYTES = 4 * 1024 * 1024
OPEN_TENANT = "_"
"""The tenant segment of jobs submitted without an API key (open mode)."""


@dataclass(frozen=True)
class ArtifactStore:
    root: S3Location
    settings: Settings

    @classmethod
    def configured(cls, settings: Settings) -> ArtifactStore | None:
        """The store of ``MODELPREP_ARTIFACT_STORE``, or None: artifacts stay on local disk."""
        if settings.artifact_store is None:
            return None
        return cls(S3Location.parse(settings.artifact_store), settings)

    def location_for(
        self, job_id: str, tenant: str | None, destination: str | None = None
    ) -> S3Location:
        """Where a job publishes: ``<root>/<tenant>/<job id>``, or ``<destination>/<job id>``
        when the tenant is granted that destination (Forbidden otherwise)."""
        if destination is None:
            return self.root.child(tenant or OPEN_TENANT, job_id)
        return check_destination(destination, tenant, self.settings).child(job_id)

    def _store(self, location: S3Location) -> S3Store:
        return store_for(location.bucket, self.settings, None, checksum=True)

    def publish(
        self,
        directory: Path,
        location: S3Location,
        digests: dict[str, str],
        ctx: JobContext | None = None,
    ) -> dict[str, str]:
        """Upload ``digests``' files (relative path -> expected sha256) from ``directory``,
        then ``directory/manifest.json`` last; returns each object's ETag. On any failure
        what was uploaded is removed and :class:`PublishFailed` (or the typed error) raised."""
        store = self._store(location)
        # a previous attempt of this job that failed while the store was unreachable (its
        # abort refused then) may have left uploads in progress here: the location is the job's
        abort_uploads(location.bucket, location.prefix + "/", self.settings, None)
        etags: dict[str, str] = {}
        try:
            for name in sorted(digests):
                etags[name] = self._upload(store, directory / name, location.key(name),
                                           digests[name], ctx)
            manifest = directory / MANIFEST
            etags[MANIFEST] = self._upload(store, manifest, location.key(MANIFEST), None, ctx)
        except BaseException as exc:
            self._discard(store, location, list(etags))
            # a store unreachable is a failed publication; an untrusted certificate is the
            # operator's CA setting, whose own type names the variables to set
            untrusted = isinstance(exc, CertificateUntrusted)
            if isinstance(exc, ServiceError) and (untrusted or not isinstance(exc, ConnectionError)):
                raise
            if isinstance(exc, Exception):
                reason = exc.message if isinstance(exc, ServiceError) else type(exc).__name__
                raise PublishFailed(f"publishing to {location.uri} failed: {reason}") from exc
            raise
        return etags

    def _upload(
        self, store: S3Store, path: Path, key: str, sha256: str | None, ctx: JobContext | None,
    ) -> str:
        digest = hashlib.sha256()

        def blocks() -> Iterator[bytes]:
            with path.open("rb") as f:
                while block := f.read(READ_BYTES):
                    digest.update(block)
                    if ctx is not None:
                        ctx.advance(len(block))
                        ctx.check_abort()
                    yield block

        def put() -> str:
            nonlocal digest
            digest = hashlib.sha256()
            result = obstore.put(store, key, blocks(), chunk_size=PART_BYTES,
                                 max_concurrency=PART_CONCURRENCY)
            return str(result.get("e_tag") or "")

        etag = call(put, f"s3://{self.root.bucket}/{key}", self.settings)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ChecksumMismatch(
                f"{path.name} changed while it was published (sha256 {digest.hexdigest()}, "
                f"manifest {sha256})"
            )
        return etag

    def _discard(self, store: S3Store, location: S3Location, names: list[str]) -> None:
        """Best effort after a failed publish or copy: abort the multipart uploads in progress
        under ``location`` (the one that failed, and any a retry left), then delete the objects
        completed. The manifest was never written, so the set is unpublished whatever remains;
        what remains is removal's (:meth:`remove`) or retention's."""
        abort_uploads(location.bucket, location.prefix + "/", self.settings, None, quick=True)
        keys = [location.key(n) for n in names if n != MANIFEST]
        if not keys:
            return
        try:
            obstore.delete(store, keys)
        except Exception:  # noqa: BLE001 - the store may be the reason publishing failed
            return

    def copy(
        self, source: S3Location, target: S3Location, names: list[str],
        ctx: JobContext | None = None,
    ) -> None:
        """Server-side copies of ``source``'s published set under ``target``, manifest last
        (result reuse: no byte passes through this process): CopyObject up to S3's 5 GB limit,
        UploadPartCopy ranges beyond it (:class:`MultipartCopy`). A missing object is
        :class:`ObjectNotFound` (the source set was removed meanwhile); what was copied is then
        removed."""
        store = self._store(source)
        if source.bucket != target.bucket:
            raise ObjectNotFound(f"{source.uri} and {target.uri} are in different buckets")
        done: list[str] = []
        order = sorted(n for n in names if n != MANIFEST) + [MANIFEST]
        large: MultipartCopy | None = None
        try:
            for name in order:
                src, dst = source.key(name), target.key(name)
                meta = call(functools.partial(obstore.head, store, src), source.uri,
                            self.settings)
                if int(meta["size"]) > COPY_OBJECT_MAX_BYTES:  # beyond CopyObject: in parts
                    large = large or MultipartCopy(source.bucket, self.settings, None)
                    large.copy(src, dst, int(meta["size"]), meta.get("e_tag"))
                else:
                    call(functools.partial(obstore.copy, store, src, dst), source.uri,
                         self.settings)
                done.append(name)
                if ctx is not None:
                    ctx.advance(1)
        except BaseException:
            self._discard(store, target, done)
            raise
        finally:
            if large is not None:
                large.close()

    def published(self, location: S3Location) -> bool:
        """Whether the set at ``location`` is published (its manifest exists)."""
        store = self._store(location)
        try:
            call(lambda: obstore.head(store, location.key(MANIFEST)), location.uri,
                 self.settings)
        except FileNotFoundError:
            return False
        return True

    def manifest(self, location: S3Location) -> dict[str, object]:
        store = self._store(location)
        data = call(lambda: obstore.get(store, location.key(MANIFEST)).bytes(), location.uri,
                    self.settings)
        loaded: dict[str, object] = json.loads(bytes(data))
        return loaded

    def url(self, location: S3Location, name: str) -> str:
        """A presigned GET of one artifact, valid ``artifact_url_seconds``, naming the public
        endpoint (a signature covers the host, so it is signed for the address clients use)."""
        store = store_for(location.bucket, self.settings, None,
                          endpoint=public_endpoint_of(self.settings))
        seconds = presign_seconds(self.settings, None, self.settings.artifact_url_seconds)
        return obstore.sign(store, "GET", location.key(name), timedelta(seconds=seconds))

    def _objects(self, store: S3Store, location: S3Location) -> list[ObjectMeta]:
        return call(lambda: [m for batch in obstore.list(store, location.prefix + "/")
                             for m in batch], location.uri, self.settings)

    def size(self, location: S3Location) -> int:
        """Bytes of every object under ``location``."""
        return sum(int(m["size"]) for m in self._objects(self._store(location), location))

    def remove(self, location: S3Location) -> int:
        """Unpublish (manifest first), then delete every object under ``location`` and abort
        the multipart uploads still in progress there (a publish that failed while the store
        was unreachable); returns the bytes of the objects removed."""
        store = self._store(location)
        what = location.uri
        objects = self._objects(store, location)
        manifest = location.key(MANIFEST)
        if any(m["path"] == manifest for m in objects):
            call(lambda: obstore.delete(store, manifest), what, self.settings)
        rest = [str(m["path"]) for m in objects if m["path"] != manifest]
        if rest:
            call(lambda: obstore.delete(store, rest), what, self.settings)
        abort_uploads(location.bucket, location.prefix + "/", self.settings, None)
        return sum(int(m["size"]) for m in objects)

    def abort_orphaned_uploads(self, now: datetime | None = None) -> int | None:
        """Abort the multipart uploads in progress under the store's prefix and every granted
        destination that began more than ``artifact_upload_orphan_after`` ago; returns how
        many, None when a prefix could not be swept (the next round tries again).

        Why: a publish that fails while the store is unreachable cannot abort its upload then,
        and the job's retry or removal, which would, may never come; the parts would stay on
        the server, billed and unlisted. An upload that young may be a live publish: kept."""
        before = (now or datetime.now(UTC)) - timedelta(
            seconds=self.settings.artifact_upload_orphan_after)
        prefixes = {self.root, *(S3Location.parse(uri)
                                 for granted in self.settings.artifact_destinations.values()
                                 for uri in granted)}
        aborted: int | None = 0
        for location in sorted(prefixes, key=lambda loc: loc.uri):
            count = abort_uploads(location.bucket, location.prefix + "/" if location.prefix
                                  else "", self.settings, None, initiated_before=before)
            aborted = None if count is None or aborted is None else aborted + count
        return aborted


def check_destination(destination: str, tenant: str | None, settings: Settings) -> S3Location:
    """A per-job destination, allowed only under a prefix granted to the tenant."""
    location = S3Location.parse(destination)
    granted = settings.artifact_destinations.get(tenant or OPEN_TENANT, [])
    if not any(location.within(S3Location.parse(g)) for g in granted):
        raise Forbidden(f"destination {location.uri} is not under a prefix granted to this "
                        "tenant (MODELPREP_ARTIFACT_DESTINATIONS)")
    return location
