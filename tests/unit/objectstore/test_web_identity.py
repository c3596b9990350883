"""How STS answers are read (service/objectstore/web_identity.py), one answer at a time: the
keys of a success, the typed error of a refusal with the token scrubbed from it, the answers
another attempt may get past. Each answer is an STS XML document parsed by botocore's own
parser for AssumeRoleWithWebIdentity, as its STS client parses it; the requests themselves go
to a real STS in tests/integration/test_web_identity.py."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import botocore.session
import pytest
from botocore.exceptions import ClientError
from botocore.parsers import create_parser

from service.config import Settings
from service.errors import AccessDenied, SourceError
from service.objectstore.web_identity import (
    TemporaryCredentials,
    WebIdentityCredentials,
    sts_endpoint_of,
    web_identity_configured,
)

OPERATION = botocore.session.get_session().get_service_model("sts").operation_model(
    "AssumeRoleWithWebIdentity")

TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2lnbmF0dXJlLW9mLXRoZS10b2tlbg"
ROLE = "arn:aws:iam::123456789012:role/modelprep"


def _provider(tmp_path: Path, **extra: object) -> WebIdentityCredentials:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    values: dict[str, object] = {
        "data_dir": tmp_path,
        "AWS_WEB_IDENTITY_TOKEN_FILE": str(token),
        "AWS_ROLE_ARN": ROLE,
        **extra,
    }
    return WebIdentityCredentials(Settings(**values))  # type: ignore[arg-type]


def _parsed(status: int, body: bytes) -> dict[str, Any]:
    """What botocore's STS client makes of an answer (its query protocol parser)."""
    parsed: dict[str, Any] = create_parser("query").parse(
        {"status_code": status, "headers": {}, "body": body}, OPERATION.output_shape)
    return parsed


def _error(status: int, code: str, message: str) -> ClientError:
    body = (
        f'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
        f"<Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error>"
        "</ErrorResponse>"
    )
    return ClientError(_parsed(status, body.encode()), OPERATION.name)  # type: ignore[arg-type]


def test_the_keys_and_expiry_of_an_answer_are_read(tmp_path: Path) -> None:
    body = (
        '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
        "<AssumeRoleWithWebIdentityResult><Credentials><AccessKeyId>ASIAX</AccessKeyId>"
        "<SecretAccessKey>secret</SecretAccessKey><SessionToken>session</SessionToken>"
        "<Expiration>2026-11-27T04:01:06Z</Expiration></Credentials>"
        "</AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>"
    )
    found = _provider(tmp_path)._keys(_parsed(200, body.encode()))
    assert found == TemporaryCredentials(
        "ASIAX", "secret", "session", datetime(2026, 11, 27, 4, 1, 6, tzinfo=UTC)
    )
    assert "secret" not in repr(found) and "session" not in repr(found)


def test_a_refusal_names_the_role_and_the_code_never_the_token(tmp_path: Path) -> None:
    provider = _provider(tmp_path)
    echoed = f"token {TOKEN} expired; also {TOKEN[:40]}.abcdefghij.klmnop"
    with pytest.raises(AccessDenied) as refused:
        provider._refusal(_error(400, "ExpiredTokenException", echoed), TOKEN)
    message = str(refused.value)
    assert ROLE in message and "ExpiredTokenException" in message
    assert TOKEN not in message and TOKEN.split(".")[2] not in message
    assert "eyJzdWIiOiJzeXN0ZW06c2EifQ" not in message


def test_server_errors_throttling_and_idp_failures_are_worth_another_attempt(
    tmp_path: Path,
) -> None:
    provider = _provider(tmp_path)
    for error in (
        _error(503, "ServiceUnavailable", "busy"),
        _error(400, "IDPCommunicationError", "issuer down"),
        _error(400, "Throttling", "slow down"),
        ClientError(_parsed(502, b"<html><body>bad gateway</body></html>"),  # a proxy's page
                    OPERATION.name),  # type: ignore[arg-type]
    ):
        assert provider._refusal(error, TOKEN).startswith("HTTP ")  # a reason to try again
    with pytest.raises(SourceError, match="without"):
        provider._keys(_parsed(200, b"<AssumeRoleWithWebIdentityResponse>"
                               b"<AssumeRoleWithWebIdentityResult/>"
                               b"</AssumeRoleWithWebIdentityResponse>"))
    with pytest.raises(SourceError, match="HTTP 404"):
        provider._refusal(ClientError(_parsed(404, b"<html>not here</html>"),
                                      OPERATION.name), TOKEN)  # type: ignore[arg-type]


def _settings(tmp_path: Path, values: dict[str, object]) -> Settings:
    """Settings with AWS_* variables given by their names (the fields' aliases)."""
    return Settings(data_dir=tmp_path, **values)  # type: ignore[arg-type]


def test_web_identity_needs_both_variables_and_finds_its_sts(tmp_path: Path) -> None:
    base = _settings(tmp_path, {})
    assert not web_identity_configured(base)
    assert not web_identity_configured(_settings(tmp_path, {"AWS_ROLE_ARN": ROLE}))
    assert sts_endpoint_of(base) == "https://sts.us-east-1.amazonaws.com"
    store = _settings(tmp_path, {"s3_endpoint": "http://store:8333/"})
    assert sts_endpoint_of(store) == "http://store:8333"
    both = _settings(
        tmp_path,
        {"s3_endpoint": "http://store:8333", "AWS_ENDPOINT_URL_STS": "https://sts.internal"},
    )
    assert sts_endpoint_of(both) == "https://sts.internal"
    empty = _settings(tmp_path, {"AWS_ENDPOINT_URL_STS": ""})
    assert empty.s3_sts_endpoint is None  # "" is unset, as the AWS SDKs read it
