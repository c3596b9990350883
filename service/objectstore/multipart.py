"""Multipart requests obstore lacks: the server-side copy of an object over CopyObject's limit,
and the uploads left in progress (listed, aborted).

S3's CopyObject copies at most 5 GB; a larger object is copied with a multipart upload whose
parts are UploadPartCopy requests (``x-amz-copy-source`` + ``x-amz-copy-source-range``), each
copying a range server-side. ``obstore.copy`` (object_store 0.12) sends CopyObject only and
offers no multipart primitives, so these requests are botocore's S3 client's
(service/objectstore/aws.py), signed with the keys :func:`static_credentials` gives now.
SeaweedFS implements UploadPartCopy (``CopyObjectPartHandler``, ranges of the source's chunks
copied between volume servers); MinIO, Ceph RGW and AWS too."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import methodcaller
from typing import Any, TypeVar

from service.config import Settings
from service.errors import ObjectNotFound, ServiceError, SourceUnreachable
from service.objectstore.aws import AwsClient, StaticCredentials, client_for
from service.objectstore.credentials import static_credentials
from service.objectstore.errors import call, classify
from service.objectstore.locations import describe_endpoint, endpoint_of
from service.objectstore.store import stall_read_seconds

T = TypeVar("T")

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
    """When the store says it began; None when its answer has none."""


class _Requests:
    """botocore S3 requests about one bucket, signed with the keys of
    :func:`static_credentials` asked for at each request (temporary keys are renewed during a
    long copy: the client is remade when they change), each through :func:`call` (retries,
    typed errors) unless ``retry`` is off."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None,
                 read_seconds: float) -> None:
        self._bucket = bucket
        self._settings = settings
        self._tenant = tenant
        self._read_seconds = read_seconds
        self._keys: StaticCredentials | None = None
        self._client: AwsClient | None = None
        static_credentials(settings, tenant)  # none to sign with: fail now, typed

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _s3(self) -> Any:
        keys = static_credentials(self._settings, self._tenant)
        if self._client is None or keys != self._keys:
            self.close()
            self._client = client_for("s3", self._settings, endpoint_of(self._settings), keys,
                                      self._read_seconds)
            self._keys = keys
        return self._client.api

    def _request(self, send: Callable[[Any], T], key: str, retry: bool = True) -> T:
        what = f"s3://{self._bucket}/{key}"
        if retry:
            return call(lambda: send(self._s3()), what, self._settings)
        try:
            return send(self._s3())
        except Exception as exc:  # every failure ends typed, none is swallowed
            mapped = classify(exc, what, self._settings)
            raise (mapped or SourceUnreachable(
                f"the object store at {describe_endpoint(self._settings)} did not answer for "
                f"{what}"
            )) from exc


class MultipartUploads(_Requests):
    """The multipart uploads in progress under a prefix: ListMultipartUploads and
    AbortMultipartUpload (obstore has neither, and ``obstore.put`` leaves the upload of a failed
    streamed put in progress: its stored parts stay on the server, unlisted, until aborted)."""

    def __init__(self, bucket: str, settings: Settings, tenant: str | None,
                 read_timeout: float | None = None) -> None:
        super().__init__(bucket, settings, tenant,
                         stall_read_seconds(settings) if read_timeout is None else read_timeout)

    def in_progress(self, prefix: str, retry: bool = True) -> list[InProgressUpload]:
        """Every upload initiated under ``prefix``, neither completed nor aborted."""

        def listing(s3: Any) -> list[InProgressUpload]:
            pages = s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self._bucket, Prefix=prefix)
            return [InProgressUpload(upload["Key"], upload["UploadId"], _aware(upload))
                    for page in pages for upload in page.get("Uploads", [])]

        return self._request(listing, prefix, retry)

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
                self._request(methodcaller("abort_multipart_upload", Bucket=self._bucket,
                                           Key=upload.key, UploadId=upload.upload_id),
                              upload.key, retry)
        return len(uploads)


def _aware(upload: dict[str, Any]) -> datetime | None:
    """An upload's ``Initiated`` (botocore parsed it), with a time zone."""
    initiated = upload.get("Initiated")
    if not isinstance(initiated, datetime):
        return None
    return initiated.astimezone(UTC) if initiated.tzinfo else initiated.replace(tzinfo=UTC)


def abort_uploads(
    bucket: str, prefix: str, settings: Settings, tenant: str | None, *, quick: bool = False,
    initiated_before: datetime | None = None,
) -> int | None:
    """Best effort: abort the multipart uploads in progress under ``prefix``; returns how many,
    or None when that failed (the store or its STS unreachable, no credentials). ``quick``:
    one attempt with a short timeout, for cleaning up after a failure the store itself may
    have caused. ``initiated_before``: only uploads begun before then
    (:meth:`MultipartUploads.abort_all`). What is left is for the bucket's
    AbortIncompleteMultipartUpload lifecycle rule, a later removal, or the sweep of orphaned
    uploads."""
    try:
        uploads = MultipartUploads(bucket, settings, tenant,
                                   min(10.0, stall_read_seconds(settings)) if quick else None)
    except ServiceError:
        return None
    try:
        return uploads.abort_all(prefix, retry=not quick, initiated_before=initiated_before)
    except ServiceError:
        return None
    finally:
        uploads.close()


class MultipartCopy(_Requests):
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
        bucket = self._bucket
        created = self._request(
            lambda s3: s3.create_multipart_upload(Bucket=bucket, Key=target), target)
        upload_id: str = created["UploadId"]
        try:
            parts = []
            condition = {"CopySourceIfMatch": etag} if etag else {}
            for number, start in enumerate(range(0, max(size, 1), COPY_PART_BYTES), 1):
                part: dict[str, Any] = {
                    "Bucket": bucket, "Key": target, "UploadId": upload_id, "PartNumber": number,
                    "CopySource": {"Bucket": bucket, "Key": source},
                    "CopySourceRange": f"bytes={start}-{min(size, start + COPY_PART_BYTES) - 1}",
                    **condition,
                }
                copied = self._request(methodcaller("upload_part_copy", **part), target)
                parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
            done = self._request(lambda s3: s3.complete_multipart_upload(
                Bucket=bucket, Key=target, UploadId=upload_id,
                MultipartUpload={"Parts": parts}), target)
            return str(done["ETag"])
        except BaseException:
            with contextlib.suppress(Exception):  # the store may be why it failed
                self._s3().abort_multipart_upload(Bucket=bucket, Key=target, UploadId=upload_id)
            raise
