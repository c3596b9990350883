"""The SeaweedFS fixture is a real S3 server that enforces its identities.

Requests are signed with the fixture's stdlib SigV4 (:func:`signed_request`) so the check does
not depend on the S3 client library under test elsewhere.
"""

from __future__ import annotations

from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)


def test_right_key_lists_buckets_wrong_key_is_denied(seaweedfs: S3Server) -> None:  # noqa: F811
    status, body = seaweedfs.request("GET", "/")
    assert status == 200, body
    assert b"ListAllMyBucketsResult" in body
    status, body = seaweedfs.request("GET", "/", secret="not-the-secret")
    assert status == 403, body
    status, body = seaweedfs.request("GET", "/", access="unknown-key")
    assert status == 403, body


def test_create_bucket_then_it_is_listed(seaweedfs: S3Server) -> None:  # noqa: F811
    seaweedfs.create_bucket("fixture-check")
    seaweedfs.create_bucket("fixture-check")  # idempotent for the owner
    status, body = seaweedfs.request("GET", "/")
    assert status == 200 and b"<Name>fixture-check</Name>" in body, body
