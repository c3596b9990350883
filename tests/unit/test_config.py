"""service/config.py: the ecosystem's variables after the service's own, each recorded with the
variable it came from, and never a secret in what start-up and /readyz show."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from service.config import STANDARD_VARIABLES, Settings, env_name, load_settings, outbound_line
from service.errors import ConfigurationError

ECOSYSTEM = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_STS", "AWS_REGION",
    "AWS_DEFAULT_REGION", "HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE", "HTTPS_PROXY",
    "HTTP_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE",
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only what a test sets: none of this machine's variables (it has SSL_CERT_FILE)."""
    for name in ECOSYSTEM:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name in ("MODELPREP_S3_ENDPOINT", "MODELPREP_S3_REGION", "MODELPREP_HF_ENDPOINT",
                 "MODELPREP_HF_TOKEN", "MODELPREP_PROXY", "MODELPREP_NO_PROXY",
                 "MODELPREP_CA_BUNDLE", "MODELPREP_S3_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MODELPREP_DATA_DIR", str(tmp_path))


def test_the_store_endpoint_is_the_services_then_aws_endpoint_url_s3_then_aws_endpoint_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://global:1")
    settings = Settings()
    assert (settings.s3_endpoint, settings.source_of("s3_endpoint")) == (
        "http://global:1", "AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3:2")
    settings = Settings()
    assert (settings.s3_endpoint, settings.source_of("s3_endpoint")) == (
        "http://s3:2", "AWS_ENDPOINT_URL_S3")
    assert settings.s3_sts_endpoint == "http://global:1"  # AWS_ENDPOINT_URL serves STS too
    monkeypatch.setenv("MODELPREP_S3_ENDPOINT", "http://own:3")
    settings = Settings()
    assert (settings.s3_endpoint, settings.source_of("s3_endpoint")) == (
        "http://own:3", "MODELPREP_S3_ENDPOINT")
    assert settings.origin("s3_endpoint") == (
        "from MODELPREP_S3_ENDPOINT; set by MODELPREP_S3_ENDPOINT, AWS_ENDPOINT_URL_S3 or "
        "AWS_ENDPOINT_URL")


def test_an_empty_variable_is_unset_as_the_sdks_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://global:1")
    assert Settings().s3_endpoint == "http://global:1"


def test_the_sts_endpoint_falls_back_to_the_stores_with_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3:2")
    settings = Settings()
    assert settings.s3_sts_endpoint is None  # web identity then asks the store's endpoint
    assert settings.source_of("s3_sts_endpoint") == "AWS_ENDPOINT_URL_S3"
    assert settings.outbound()["sts_endpoint"] == {"value": "http://s3:2",
                                                  "source": "AWS_ENDPOINT_URL_S3"}


def test_the_region_is_the_services_then_aws_region_then_aws_default_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert (Settings().s3_region, Settings().source_of("s3_region")) == ("us-east-1", "default")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert Settings().s3_region == "eu-west-3"
    monkeypatch.setenv("AWS_REGION", "eu-central-1")
    assert (Settings().s3_region, Settings().source_of("s3_region")) == (
        "eu-central-1", "AWS_REGION")
    monkeypatch.setenv("MODELPREP_S3_REGION", "ap-south-1")
    assert Settings().s3_region == "ap-south-1"


def test_hub_variables_are_service_wide_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror:8090")
    monkeypatch.setenv("HF_TOKEN", "hf_secretFromThePlatform")
    settings = Settings()
    assert settings.hf_endpoint == "http://mirror:8090"
    assert settings.hf_token is not None
    assert settings.hf_token.get_secret_value() == "hf_secretFromThePlatform"
    assert settings.source_of("hf_token") == "HF_TOKEN"
    shown = outbound_line(settings.outbound()) + str(settings.outbound())
    assert "hf_secretFromThePlatform" not in shown
    assert settings.outbound()["hf_token"] == {"value": "set", "source": "HF_TOKEN"}
    monkeypatch.setenv("MODELPREP_HF_ENDPOINT", "http://own:1")
    assert Settings().hf_endpoint == "http://own:1"


@pytest.mark.parametrize(("value", "offline"), [
    ("1", True), ("ON", True), ("yes", True), ("True", True), ("0", False), ("", False),
    ("off", False), ("anything", False),
])
def test_hf_hub_offline_is_read_as_huggingface_hub_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str, offline: bool,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert Settings().hf_hub_offline is offline


def test_the_proxy_is_the_services_for_both_schemes_else_one_variable_per_scheme(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw@secure:3128")
    monkeypatch.setenv("http_proxy", "plain:3128")  # lowercase, no scheme: as curl reads it
    monkeypatch.setenv("NO_PROXY", ".internal")
    routes = Settings().proxy_routes
    assert routes.for_target("https", "huggingface.co") == "http://user:pw@secure:3128"
    assert routes.for_target("http", "mirror.example") == "http://plain:3128"
    assert routes.for_target("https", "store.internal") is None
    assert routes.describe(routes.https or "") == "the proxy http://secure:3128 (from HTTPS_PROXY)"
    outbound = Settings().outbound()
    assert outbound["https_proxy"] == {"value": "http://secure:3128", "source": "HTTPS_PROXY"}
    assert "pw" not in outbound_line(Settings().outbound())
    monkeypatch.setenv("MODELPREP_PROXY", "http://own:8080")
    routes = Settings().proxy_routes
    assert routes.https == routes.http == "http://own:8080"
    assert routes.https_source == "MODELPREP_PROXY"


def test_the_ca_bundle_is_the_services_then_ssl_cert_file_then_requests_ca_bundle(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    bundles = [tmp_path / f"{name}.pem" for name in ("requests", "ssl", "own")]
    for bundle in bundles:
        bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    assert Settings().ca_bundle is None
    for name, bundle in zip(("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "MODELPREP_CA_BUNDLE"),
                            bundles, strict=True):
        monkeypatch.setenv(name, str(bundle))
        settings = Settings()
        assert (settings.ca_bundle, settings.source_of("ca_bundle")) == (bundle, name)
        assert settings.egress_policy.ca_source == name


def test_a_ca_bundle_that_is_not_a_file_stops_start_up_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigurationError, match="SSL_CERT_FILE: the CA bundle .* is not a file"):
        load_settings()


def test_every_standard_variable_is_a_documented_setting() -> None:
    settings = list(STANDARD_VARIABLES)
    for name, fallbacks in STANDARD_VARIABLES.items():
        assert env_name(name).startswith("MODELPREP_")
        for fallback in fallbacks:
            # an ecosystem variable, or a setting of the table resolved before this one
            assert (not env_name(fallback).startswith("MODELPREP_")
                    or settings.index(fallback) < settings.index(name))
            assert Settings.model_fields[fallback].description


def _bundles(tmp_path: Path, *names: str) -> list[Path]:
    bundles = [tmp_path / f"{name}.pem" for name in names]
    for bundle in bundles:
        bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    return bundles


def test_the_stores_ca_bundle_is_its_own_then_aws_ca_bundle_then_the_ca_bundles_chain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    assert Settings().s3_ca_bundle is None
    assert Settings().source_of("s3_ca_bundle") == "default"
    requests, ssl_file, general, aws, own = _bundles(
        tmp_path, "requests", "ssl", "general", "aws", "own")
    for name, bundle in (("REQUESTS_CA_BUNDLE", requests), ("SSL_CERT_FILE", ssl_file),
                         ("MODELPREP_CA_BUNDLE", general)):
        monkeypatch.setenv(name, str(bundle))
        settings = Settings()  # no store variable yet: the general bundle, from its variable
        assert (settings.s3_ca_bundle, settings.source_of("s3_ca_bundle")) == (bundle, name)
    for name, bundle in (("AWS_CA_BUNDLE", aws), ("MODELPREP_S3_CA_BUNDLE", own)):
        monkeypatch.setenv(name, str(bundle))
        settings = Settings()
        assert (settings.s3_ca_bundle, settings.source_of("s3_ca_bundle")) == (bundle, name)
        assert (settings.ca_bundle, settings.source_of("ca_bundle")) == (
            general, "MODELPREP_CA_BUNDLE")
    assert settings.outbound()["s3_ca_bundle"] == {"value": str(own),
                                                   "source": "MODELPREP_S3_CA_BUNDLE"}
    assert settings.variables_of("s3_ca_bundle") == (
        "MODELPREP_S3_CA_BUNDLE, AWS_CA_BUNDLE, MODELPREP_CA_BUNDLE, SSL_CERT_FILE or "
        "REQUESTS_CA_BUNDLE")


def test_aws_ca_bundle_is_the_stores_trust_and_never_the_hubs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A store signed by an internal CA: the hub, HTTP sources and callbacks keep the public
    roots (no general bundle: certifi's) while the store's and STS's policy trusts the CA."""
    store_ca = tmp_path / "store-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(store_ca))
    monkeypatch.setenv("AWS_CA_BUNDLE", str(store_ca))
    settings = Settings()
    assert settings.ca_bundle is None
    assert settings.egress_policy.ca_bundle is None
    assert settings.outbound()["ca_bundle"] == {"value": "certifi", "source": "default"}
    store = settings.store_egress_policy
    assert (store.ca_bundle, store.ca_source) == (store_ca, "AWS_CA_BUNDLE")
    assert store.ca_variables.startswith("MODELPREP_S3_CA_BUNDLE, AWS_CA_BUNDLE, ")
    assert settings.egress_policy.ca_variables == (
        "MODELPREP_CA_BUNDLE, SSL_CERT_FILE or REQUESTS_CA_BUNDLE")
    assert store.ssl_context() is not settings.egress_policy.ssl_context()


def test_a_store_ca_bundle_that_is_not_a_file_stops_start_up_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigurationError, match="AWS_CA_BUNDLE: the CA bundle .* is not a file"):
        load_settings()


def test_an_empty_aws_ca_bundle_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", "")
    monkeypatch.setenv("MODELPREP_S3_CA_BUNDLE", "")
    assert Settings().s3_ca_bundle is None
