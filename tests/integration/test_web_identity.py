"""Web identity against a real STS: SeaweedFS's AssumeRoleWithWebIdentity, trusting an OIDC
issuer on loopback whose JWKS it fetches (tests/fixtures/oidc.py), never a stub.

The service holds no key: only a token file and a role. Its temporary keys read and write
through obstore (``credential_provider``) and sign the requests obstore cannot make
(UploadPartCopy, CompleteMultipartUpload, ListMultipartUploads, AbortMultipartUpload) with their
session token; a rotated token file is read at the next refresh; a forged token, an unknown role,
a dead STS and one the egress policy refuses each fail typed, and no message holds the token.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import obstore
import pytest

from service.config import Settings
from service.errors import AccessDenied, EgressRefused, SourceUnreachable
from service.objectstore import (
    MultipartCopy,
    MultipartUploads,
    StaticCredentials,
    call,
    classify,
    static_credentials,
    store_for,
)
from service.objectstore.aws import client_for
from service.objectstore.web_identity import (
    OBSTORE_EARLY,
    REFRESH_MARGIN,
    URL_SLACK,
    WebIdentityCredentials,
)
from tests.fixtures.oidc import (  # noqa: F401  (fixture)
    ROLE_ARN,
    SigningKey,
    WebIdentityStore,
    web_identity_store,
)
from tests.fixtures.seaweedfs import S3Server, signed_request
from tests.fixtures.service import free_port

if TYPE_CHECKING:
    from obstore.store import S3Credential


def _settings(tmp_path: Path, store: WebIdentityStore, token: str, **extra: object) -> Settings:
    """Web identity only: a token file and a role (the keys of the environment are unset by
    :func:`_no_keys`), the store's own endpoint as STS."""
    token_file = tmp_path / "token"
    token_file.write_text(token)
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "s3_endpoint": store.server.endpoint,
        "egress_allowlist": ["127.0.0.1"],
        "download_retries": 1,
        "download_backoff_seconds": 0.01,
        "AWS_WEB_IDENTITY_TOKEN_FILE": str(token_file),
        "AWS_ROLE_ARN": ROLE_ARN,
        **extra,
    }
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No key pair anywhere in the chain: environment nor shared credentials file."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


@pytest.fixture
def bucket(web_identity_store: WebIdentityStore) -> str:  # noqa: F811
    name = f"wi-{uuid.uuid4().hex[:12]}"
    web_identity_store.server.create_bucket(name)
    return name


def test_temporary_keys_from_the_token_read_and_write_through_obstore(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
    bucket: str,
) -> None:
    settings = _settings(tmp_path, web_identity_store, web_identity_store.issuer.token())
    store = store_for(bucket, settings, None)
    call(lambda: obstore.put(store, "a/b.txt", b"written with a session token"), "put", settings)
    got = call(lambda: bytes(obstore.get(store, "a/b.txt").bytes()), "get", settings)
    assert got == b"written with a session token"
    keys = static_credentials(settings, None)
    assert keys.access_key_id.startswith("ASIA") and keys.session_token  # temporary ones
    # the same keys without their session token are refused: the token is what is signed
    status, body = signed_request(
        web_identity_store.server.endpoint,
        "GET",
        f"/{bucket}",
        keys.access_key_id,
        keys.secret_access_key,
    )
    assert status == 403, (status, body)


def test_signed_multipart_copy_list_and_abort_carry_the_session_token(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
    bucket: str,
) -> None:
    """The > 5 GB copy path's requests, signed here with temporary keys: CreateMultipartUpload,
    UploadPartCopy, CompleteMultipartUpload, then ListMultipartUploads and Abort."""
    settings = _settings(tmp_path, web_identity_store, web_identity_store.issuer.token())
    store = store_for(bucket, settings, None)
    data = b"0123456789" * 1000
    put = obstore.put(store, "src/model.bin", data)
    copy = MultipartCopy(bucket, settings, None)
    try:
        etag = copy.copy("src/model.bin", "dst/model.bin", len(data), put["e_tag"])
    finally:
        copy.close()
    assert etag.strip('"').endswith("-1"), etag  # a multipart object of one copied part
    assert bytes(obstore.get(store, "dst/model.bin").bytes()) == data

    s3 = client_for("s3", settings, settings.s3_endpoint or "", static_credentials(settings, None),
                    30.0)
    uploads = MultipartUploads(bucket, settings, None)
    try:
        created = s3.api.create_multipart_upload(Bucket=bucket, Key="left/open.bin")
        assert created["UploadId"]
        assert [u.key for u in uploads.in_progress("left/")] == ["left/open.bin"]
        assert uploads.abort_all("left/") == 1
        assert uploads.in_progress("left/") == []
    finally:
        uploads.close()
        s3.close()


def test_a_rotated_token_file_is_read_at_the_next_refresh(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
) -> None:
    """Keys are kept until REFRESH_MARGIN before they expire, then asked for again with the
    token file as it is then: a forged token there is refused, a fresh valid one gives new
    keys."""
    issuer = web_identity_store.issuer
    settings = _settings(tmp_path, web_identity_store, issuer.token())
    now = [datetime.now(UTC)]
    provider = WebIdentityCredentials(settings, clock=lambda: now[0])
    first = provider.current()
    assert first.expires_at - now[0] > REFRESH_MARGIN
    forged = issuer.token(key=SigningKey.generate(tmp_path, "other"))
    (tmp_path / "token").write_text(forged)
    assert provider.current() == first  # cached: the file is not read before a refresh
    now[0] = first.expires_at - REFRESH_MARGIN
    with pytest.raises(AccessDenied) as refused:
        provider.current()
    assert ROLE_ARN in str(refused.value) and forged not in str(refused.value)
    (tmp_path / "token").write_text(issuer.token())
    second = provider.current()
    assert second.access_key_id != first.access_key_id


def test_keys_outlive_every_url_presigned_with_them(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
) -> None:
    """A presigned URL dies with the keys that signed it: with URLs valid 20 min (keys of 1 h),
    keys are renewed when 21 min are left, and obstore (which asks again 5 min before the expiry it is
    handed) is handed an expiry that makes it ask at that same point."""
    settings = _settings(
        tmp_path, web_identity_store, web_identity_store.issuer.token(), artifact_url_seconds=1200
    )
    now = [datetime.now(UTC)]
    provider = WebIdentityCredentials(settings, clock=lambda: now[0])
    first = provider.current()
    assert provider.margin == timedelta(seconds=1200) + URL_SLACK > REFRESH_MARGIN
    handed = provider()
    assert handed["expires_at"] - OBSTORE_EARLY == first.expires_at - provider.margin
    now[0] = first.expires_at - provider.margin - timedelta(seconds=1)
    assert provider.current() == first
    assert provider.url_seconds(1200) == 1200
    now[0] = first.expires_at - provider.margin
    assert provider.current().access_key_id != first.access_key_id


def test_a_url_longer_than_the_role_session_is_shortened_to_the_keys_life(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
) -> None:
    """URLs of 7 days from keys of SeaweedFS's 1 h sessions: each URL lasts as long as its keys
    less a minute, and the keys are kept for half their life (not renewed at every call)."""
    week = 7 * 86400
    settings = _settings(
        tmp_path, web_identity_store, web_identity_store.issuer.token(), artifact_url_seconds=week
    )
    now = [datetime.now(UTC)]
    provider = WebIdentityCredentials(settings, clock=lambda: now[0])
    keys = provider.current()
    life = keys.expires_at - now[0]
    assert timedelta(minutes=2) < life < timedelta(days=1)
    assert provider.url_seconds(week) == int((life - URL_SLACK).total_seconds())
    start = now[0]
    now[0] = start + life / 2 - timedelta(seconds=1)
    assert provider.current() == keys
    now[0] = start + life / 2 + timedelta(seconds=1)
    assert provider.current().access_key_id != keys.access_key_id


def test_a_forged_token_or_an_unknown_role_is_access_denied_naming_the_role(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
    bucket: str,
) -> None:
    issuer = web_identity_store.issuer
    forged = issuer.token(key=SigningKey.generate(tmp_path, "forger"))
    settings = _settings(tmp_path, web_identity_store, forged)
    with pytest.raises(AccessDenied) as denied:
        store_for(bucket, settings, None)
    message = str(denied.value)
    assert ROLE_ARN in message and forged not in message and forged[:40] not in message
    with pytest.raises(AccessDenied):
        MultipartUploads(bucket, settings, None)

    other = "arn:aws:iam::role/not-trusted"
    settings = _settings(tmp_path, web_identity_store, issuer.token(), AWS_ROLE_ARN=other)
    with pytest.raises(AccessDenied) as denied:
        store_for(bucket, settings, None)
    assert other in str(denied.value)
    (tmp_path / "token").unlink()
    with pytest.raises(AccessDenied, match="cannot read the web identity token file"):
        store_for(bucket, settings, None)


def test_an_unreachable_sts_is_source_unreachable_and_one_the_policy_refuses_is_refused(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
    bucket: str,
) -> None:
    token = web_identity_store.issuer.token()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = _settings(tmp_path, web_identity_store, token, AWS_ENDPOINT_URL_STS=dead)
    with pytest.raises(SourceUnreachable, match="after 2 attempts") as unreachable:
        store_for(bucket, settings, None)
    assert token not in str(unreachable.value)
    settings = _settings(tmp_path, web_identity_store, token, egress_allowlist=[])
    with pytest.raises(EgressRefused):
        store_for(bucket, settings, None)


def test_a_provider_failure_inside_obstore_keeps_its_type(tmp_path: Path) -> None:
    """obstore reports an exception of its ``credential_provider`` as UnauthenticatedError
    naming it (``External AWS credential provider: <class>: <message>``); ``classify`` gives
    back the service's type (pins obstore 0.12's message)."""
    from obstore.store import S3Store

    class Failing:
        """A provider whose every call fails with ``error``."""

        def __init__(self, error: Exception) -> None:
            self.error = error

        def __call__(self) -> S3Credential:
            raise self.error

    for raised, expected in (
        (SourceUnreachable("the STS did not answer"), SourceUnreachable),
        (AccessDenied("role refused"), AccessDenied),
    ):
        store = S3Store(
            "b",
            endpoint="http://127.0.0.1:9",  # never reached: the provider fails first
            region="us-east-1",
            client_options={"allow_http": True},
            retry_config={"max_retries": 0},
            credential_provider=Failing(raised),
        )
        with pytest.raises(Exception) as caught:
            obstore.get(store, "k")
        mapped = classify(caught.value, "s3://b/k")
        assert type(mapped) is expected, (caught.value, mapped)
        assert str(raised) in str(mapped)


def test_environment_keys_come_before_web_identity(
    tmp_path: Path,
    web_identity_store: WebIdentityStore,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server: S3Server = web_identity_store.server
    settings = _settings(tmp_path, web_identity_store, "not read")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    assert static_credentials(settings, None) == StaticCredentials(
        server.access_key, server.secret_key
    )
