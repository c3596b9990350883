"""S3-compatible object storage, used by ``s3://`` sources and by the artifact store.

The map, in import order (each module imports only those above it):

- ``aws``: botocore's clients for the requests obstore lacks, sent through the egress client,
  and the AWS SDKs' credential chain (profiles, container and instance credentials).
- ``web_identity``: a Kubernetes service account's token exchanged for temporary keys (STS
  AssumeRoleWithWebIdentity, cached per role and process).
- ``locations``: :class:`S3Location` (``s3://bucket/prefix``, validated), the endpoint requests
  and presigned URLs go to, the egress check of that endpoint.
- ``errors``: :func:`classify` (an object-store failure to a typed error) and :func:`call` (one
  request, retried until it succeeds or fails typed).
- ``credentials``: the credential chain (tenant keys, environment, web identity, the rest of
  the SDK chain) and the keys botocore's requests are signed with (:func:`static_credentials`).
- ``store``: :func:`store_for`, an obstore client of a bucket with those credentials, and
  :func:`list_dir`.
- ``multipart``: botocore's S3 requests: the server-side copy of an object over CopyObject's 5 GB limit
  (:class:`MultipartCopy`) and the uploads left in progress (:class:`MultipartUploads`,
  :func:`abort_uploads`).

Callers import the names below from ``service.objectstore``.
"""

from service.objectstore.aws import StaticCredentials
from service.objectstore.credentials import (
    credential_source,
    outbound_report,
    presign_seconds,
    static_credentials,
)
from service.objectstore.errors import call, classify
from service.objectstore.locations import (
    S3Location,
    check_egress,
    endpoint_of,
    public_endpoint_of,
)
from service.objectstore.multipart import (
    COPY_OBJECT_MAX_BYTES,
    COPY_PART_BYTES,
    InProgressUpload,
    MultipartCopy,
    MultipartUploads,
    abort_uploads,
)
from service.objectstore.store import list_dir, stall_read_seconds, store_for

__all__ = [
    "COPY_OBJECT_MAX_BYTES",
    "COPY_PART_BYTES",
    "InProgressUpload",
    "MultipartCopy",
    "MultipartUploads",
    "S3Location",
    "StaticCredentials",
    "abort_uploads",
    "call",
    "check_egress",
    "classify",
    "credential_source",
    "endpoint_of",
    "list_dir",
    "outbound_report",
    "presign_seconds",
    "public_endpoint_of",
    "stall_read_seconds",
    "static_credentials",
    "store_for",
]
