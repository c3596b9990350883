"""The SeaweedFS fixture is a real S3 server that enforces its identities.

Requests are signed here with a minimal AWS SigV4 (stdlib only) so the check does not depend on
the S3 client library under test elsewhere.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.error
import urllib.request

from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)


def _list_buckets(server: S3Server, access: str, secret: str) -> tuple[int, bytes]:
    now = datetime.datetime.now(datetime.UTC)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    host = server.endpoint.removeprefix("http://")
    payload = hashlib.sha256(b"").hexdigest()
    canonical = "\n".join(
        [
            "GET",
            "/",
            "",
            f"host:{host}",
            f"x-amz-content-sha256:{payload}",
            f"x-amz-date:{amz_date}",
            "",
            "host;x-amz-content-sha256;x-amz-date",
            payload,
        ]
    )
    scope = f"{day}/us-east-1/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + secret).encode()
    for part in (day, "us-east-1", "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    request = urllib.request.Request(
        server.endpoint + "/",
        headers={
            "x-amz-date": amz_date,
            "x-amz-content-sha256": payload,
            "Authorization": (
                f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                f"SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature={signature}"
            ),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def test_right_key_lists_buckets_wrong_key_is_denied(seaweedfs: S3Server) -> None:  # noqa: F811
    status, body = _list_buckets(seaweedfs, seaweedfs.access_key, seaweedfs.secret_key)
    assert status == 200, body
    assert b"ListAllMyBucketsResult" in body
    status, body = _list_buckets(seaweedfs, seaweedfs.access_key, "not-the-secret")
    assert status == 403, body
    status, body = _list_buckets(seaweedfs, "unknown-key", seaweedfs.secret_key)
    assert status == 403, body
