"""The object store's own CA bundle (``MODELPREP_S3_CA_BUNDLE``, else ``AWS_CA_BUNDLE``, else the
general one) against a real TLS server on loopback whose certificate a private CA (``trustme``)
signed: obstore's requests and botocore's (S3 and STS, through the egress client) trust it when
the bundle names that CA, and otherwise fail at once ``certificate_untrusted`` naming the
variables. Pins the form of obstore's refusal (rustls's ``InvalidCertificate(UnknownIssuer)``)
that :func:`service.objectstore.errors.classify` reads."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from botocore.parsers import ResponseParserError
from obstore.exceptions import UnauthenticatedError

from service.config import Settings
from service.errors import CertificateUntrusted, ObjectNotFound, SourceError
from service.objectstore import MultipartUploads, S3Location, classify, list_dir, store_for
from service.objectstore.aws import client_for
from tests.fixtures.http_server import FileServer

CA_VARIABLES = (
    "MODELPREP_S3_CA_BUNDLE, AWS_CA_BUNDLE, MODELPREP_CA_BUNDLE, SSL_CERT_FILE or "
    "REQUESTS_CA_BUNDLE"
)


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[trustme.CA, Path]:
    ca = trustme.CA()
    bundle = tmp_path_factory.mktemp("ca") / "storage-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return ca, bundle


@pytest.fixture
def store_server(private_ca: tuple[trustme.CA, Path]) -> Iterator[FileServer]:
    """An https:// server on 127.0.0.1 (it answers 404 to any S3 request it gets)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    private_ca[0].issue_cert("127.0.0.1").configure_cert(context)
    server = FileServer(tls=context)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_machine_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the bundles a test names (this machine sets SSL_CERT_FILE)."""
    for name in (
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "AWS_CA_BUNDLE",
        "MODELPREP_CA_BUNDLE",
        "MODELPREP_S3_CA_BUNDLE",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)


def _settings(server: FileServer, tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        s3_endpoint=server.base_url,
        download_retries=3,
        download_backoff_seconds=0.01,
        egress_allowlist=["127.0.0.1"],
        s3_credentials={"t": {"access_key_id": "key", "secret_access_key": "secret"}},
    )


def test_obstore_refuses_a_store_certificate_of_an_unnamed_ca_at_once_naming_the_variables(
    store_server: FileServer,
    tmp_path: Path,
) -> None:
    settings = _settings(store_server, tmp_path)
    store = store_for("models", settings, "t")
    with pytest.raises(CertificateUntrusted) as refused:  # not retried into SourceUnreachable
        list_dir(store, S3Location("models", "llama"), settings)
    message = refused.value.message
    assert "UnknownIssuer" in message and store_server.base_url in message
    assert "not trusted by the public CA roots" in message
    assert message.endswith(f"name its CA's bundle in {CA_VARIABLES}")
    assert store_server.seen == []


def test_obstore_trusts_the_store_through_aws_ca_bundle_alone(
    store_server: FileServer,
    private_ca: tuple[trustme.CA, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(private_ca[1]))
    settings = _settings(store_server, tmp_path)
    assert settings.ca_bundle is None
    store = store_for("models", settings, "t")
    with pytest.raises(ObjectNotFound):  # the server's 404: TLS was established
        list_dir(store, S3Location("models", "llama"), settings)
    assert next(seen.path for seen in store_server.seen).startswith("/models")


def test_botocores_s3_requests_use_the_stores_bundle_not_the_general_one(
    store_server: FileServer,
    private_ca: tuple[trustme.CA, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    monkeypatch.setenv("SSL_CERT_FILE", str(other))  # the hub's trust, not the store's
    uploads = MultipartUploads("models", _settings(store_server, tmp_path), "t")
    with pytest.raises(CertificateUntrusted) as refused:
        uploads.in_progress("llama")
    assert f"the CA bundle {other} (SSL_CERT_FILE)" in refused.value.message
    assert CA_VARIABLES in refused.value.message

    monkeypatch.setenv("MODELPREP_S3_CA_BUNDLE", str(private_ca[1]))
    settings = _settings(store_server, tmp_path)
    assert settings.ca_bundle == other
    with pytest.raises(SourceError):  # the server's 404 to ListMultipartUploads
        MultipartUploads("models", settings, "t").in_progress("llama")
    assert any(seen.path.startswith("/models") for seen in store_server.seen)


def test_sts_requests_use_the_stores_bundle(
    store_server: FileServer,
    private_ca: tuple[trustme.CA, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def assume_role() -> None:
        sts = client_for("sts", _settings(store_server, tmp_path), store_server.base_url, None, 5.0)
        try:
            sts.api.assume_role_with_web_identity(
                RoleArn="arn:aws:iam::000000000000:role/r",
                RoleSessionName="modelprep",
                WebIdentityToken="t" * 20,
            )
        finally:
            sts.close()

    with pytest.raises(CertificateUntrusted, match="AWS_CA_BUNDLE"):
        assume_role()
    monkeypatch.setenv("AWS_CA_BUNDLE", str(private_ca[1]))
    # TLS established: the server's own answer, its HTML 501 page to a POST
    with pytest.raises(ResponseParserError, match="Unsupported method"):
        assume_role()


def test_an_sts_certificate_refused_inside_obstores_credential_provider_stays_typed() -> None:
    failure = UnauthenticatedError(
        "External AWS credential provider: CertificateUntrusted: the TLS certificate of sts.x "
        "is not trusted by certifi's public CA bundle: unable to get local issuer certificate; "
        f"name its CA's bundle in {CA_VARIABLES}"
    )
    mapped = classify(failure, "s3://models/llama")
    assert isinstance(mapped, CertificateUntrusted)
    assert mapped.message.startswith("the TLS certificate of sts.x")
