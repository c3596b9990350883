"""Multipart requests obstore lacks: the server-side copy of an object over CopyObject's limit,
and the uploads left in progress (listed, aborted).

S3's CopyObject copies at most 5 GB; a larger object is copied with a multipart upload whose
parts are UploadPartCopy requests (``x-amz-copy-source`` + ``x-amz-copy-source-range``), each
copying a range server-side. ``obstore.copy`` (object_store 0.12) sends CopyObject only and
offers no multipart primitives, so these requests are signed here (service/objectstore/
signing.py) and sent with httpx. SeaweedFS implements UploadPartCopy (``CopyObjectPartHandler``,
ranges of the source's chunks copied between volume servers); MinIO, Ceph RGW and AWS too."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime
from xml.etree import ElementTree

import httpx

from service.config import Settings
from service.errors import ObjectNotFound, ServiceError
from service.objectstore.signing import _element, _quote_key, _SignedRequests, _Transient
from service.objectstore.store import stall_read_seconds

COPY_OBJECT_MAX_BYTES = 5 * 1000**3
"""S3's CopyObject limit (5 GB); a larger source is copied part by part."""

COPY_PART_BYTES = 1024**3
"""UploadPartCopy range size: within S3's 5 MiB..5 GiB, 10,000 parts cover 10 TiB."""


@dataclass(frozen=True)
class InProgressUpload:
    """One multipart upload neither completed nor aborted (ListMultipartUploads)."""

    key: str
    upload_id: str
    initiated: datetime | None
    """When the store says it began; None when its answer has no readable ``Initiated``."""

def _timestamp(text: str | None) -> datetime | None:
    """An S3 timestamp (``2026-11-27T01:02:03.000Z``), None when absent or unreadable."""
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)

class MultipartUploads(_SignedRequests):
    """The multipart uploads in progress under a prefix: ListMultipartUploads and
    AbortMultipartUpload (obstore has neither, and ``obstore.put`` leaves the upload of a failed
    streamed put in progress: its stored parts stay on the server, unlisted, until aborted)."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None,
                 read_timeout: float | None = None) -> None:
        super().__init__(bucket, settings, tenant,
                         stall_read_seconds(settings) if read_timeout is None else read_timeout)

    def in_progress(self, prefix: str, retry: bool = True) -> list[InProgressUpload]:
        """Every upload initiated under ``prefix``, neither completed nor aborted."""
        found: list[InProgressUpload] = []
        query = {"uploads": "", "prefix": prefix}
        while True:
            body = self._request("GET", "", query, retry=retry).content
            root = ElementTree.fromstring(body)
            for upload in root.findall("{*}Upload"):
                found.append(InProgressUpload(upload.findtext("{*}Key") or "",
                                              upload.findtext("{*}UploadId") or "",
                                              _timestamp(upload.findtext("{*}Initiated"))))
            if root.findtext("{*}IsTruncated") != "true":
                return found
            query = {**query, "key-marker": root.findtext("{*}NextKeyMarker") or "",
                     "upload-id-marker": root.findtext("{*}NextUploadIdMarker") or ""}

    def abort_all(
        self, prefix: str, retry: bool = True, initiated_before: datetime | None = None,
    ) -> int:
        """Abort every upload in progress under ``prefix`` (the store drops their parts), or
        only those initiated before ``initiated_before`` (one whose start the store does not
        say is kept: it may be live); returns how many. An upload completed or aborted
        meanwhile is not an error."""
        uploads = [u for u in self.in_progress(prefix, retry)
                   if initiated_before is None
                   or (u.initiated is not None and u.initiated < initiated_before)]
        for upload in uploads:
            with contextlib.suppress(ObjectNotFound):  # NoSuchUpload: already gone
                self._request("DELETE", upload.key, {"uploadId": upload.upload_id}, retry=retry)
        return len(uploads)

def abort_uploads(
    bucket: str, prefix: str, settings: Settings, tenant: str | None, *, quick: bool = False,
    initiated_before: datetime | None = None,
) -> int | None:
    """Best effort: abort the multipart uploads in progress under ``prefix``; returns how many,
    or None when that failed (the store or its STS unreachable, or no key pair to sign with:
    instance credentials stay inside object_store). ``quick``: one attempt with a short
    timeout, for cleaning up after a failure the store itself may have caused.
    ``initiated_before``: only uploads begun before then (:meth:`MultipartUploads.abort_all`).
    What is left is for the bucket's AbortIncompleteMultipartUpload lifecycle rule, a later
    removal, or the sweep of orphaned uploads."""
    try:
        uploads = MultipartUploads(bucket, settings, tenant,
                                   min(10.0, stall_read_seconds(settings)) if quick else None)
    except ServiceError:
        return None
    try:
        return uploads.abort_all(prefix, retry=not quick, initiated_before=initiated_before)
    except (ServiceError, _Transient, httpx.HTTPError, ElementTree.ParseError):
        return None
    finally:
        uploads.close()

class MultipartCopy(_SignedRequests):
    """Copy one object of a bucket to another key with UploadPartCopy, no byte through here.

    Each request goes through :func:`call` (retries, typed errors); a failure aborts the
    upload so the store drops the copied parts."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None) -> None:
        # a part copy answers when the store has copied the range: allow for 1 GiB of it
        super().__init__(bucket, settings, tenant,
                         min(600.0, max(60.0, settings.download_stall_seconds)))

    def copy(self, source: str, target: str, size: int, etag: str | None = None) -> str:
        """Copy ``source`` (``size`` bytes; ``etag``: refuse a source that changed meanwhile)
        to ``target`` in parts of :data:`COPY_PART_BYTES`; returns the new object's ETag."""
        created = self._request("POST", target, {"uploads": ""})
        upload_id = _element(created.content, "UploadId")
        try:
            parts = []
            copy_source = f"/{self._bucket}/{_quote_key(source)}"
            for number, start in enumerate(range(0, max(size, 1), COPY_PART_BYTES), 1):
                end = min(size, start + COPY_PART_BYTES) - 1
                headers = {"x-amz-copy-source": copy_source,
                           "x-amz-copy-source-range": f"bytes={start}-{end}"}
                if etag:
                    headers["x-amz-copy-source-if-match"] = etag
                copied = self._request("PUT", target, {"partNumber": str(number),
                                                       "uploadId": upload_id}, headers)
                parts.append((number, _element(copied.content, "ETag")))
            body = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>"
                           for n, e in parts)
            done = self._request(
                "POST", target, {"uploadId": upload_id},
                {"content-type": "application/xml"},
                f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode(),
            )
            return _element(done.content, "ETag")
        except BaseException:
            with contextlib.suppress(Exception):  # the store may be why it failed
                self._request("DELETE", target, {"uploadId": upload_id})
            raise
