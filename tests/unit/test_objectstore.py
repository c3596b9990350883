"""service/objectstore.py without a server: locations, the credential chain's file step, and
how obstore's errors map to typed ones (the message format of its GenericError included)."""

from __future__ import annotations

from pathlib import Path

import pytest
from obstore.exceptions import GenericError, PermissionDeniedError

from service.errors import (
    AccessDenied,
    InvalidRequest,
    ObjectNotFound,
    SourceError,
)
from service.objectstore import S3Location, _shared_file_credentials, classify


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
