"""service/egress.py without a network: NO_PROXY matching and the check of a target reached
through a proxy (a resolver given as a function, as the policy takes one)."""

from __future__ import annotations

import pytest

from service.egress import EgressPolicy, Proxy, without_userinfo
from service.errors import EgressRefused

PROXY = "http://proxy.internal:3128"


@pytest.mark.parametrize(("no_proxy", "host", "bypassed"), [
    ("*", "anything.example", True),
    ("example.com", "example.com", True),
    ("example.com", "hub.example.com", True),
    (".example.com", "hub.example.com", True),
    ("*.example.com", "hub.example.com", True),
    ("example.com", "notexample.com", False),
    ("localhost:8080, 10.0.0.0/8", "10.1.2.3", True),
    ("10.0.0.0/8", "11.1.2.3", False),
    ("localhost:8080", "localhost", True),
    ("::1", "[::1]", True),
    ("", "example.com", False),
])
def test_no_proxy_names_hosts_domains_and_networks(
    no_proxy: str, host: str, bypassed: bool,
) -> None:
    proxy = Proxy(PROXY, PROXY, no_proxy)
    assert proxy.bypassed(host) is bypassed
    assert (proxy.for_target("https", host) is None) is bypassed


def test_each_scheme_has_its_own_proxy() -> None:
    proxy = Proxy(http=None, https=PROXY)
    assert proxy.for_target("https", "example.com") == PROXY
    assert proxy.for_target("http", "example.com") is None


def test_a_proxy_url_is_shown_without_its_credentials() -> None:
    assert without_userinfo("http://user:secret@proxy:3128") == "http://proxy:3128"
    assert without_userinfo("http://proxy:3128") == "http://proxy:3128"


def _policy(addresses: dict[str, list[str]], allow: list[str] | None = None) -> EgressPolicy:
    def resolver(host: str, port: int) -> list[str]:
        if host not in addresses:
            raise EgressRefused(f"host {host!r} does not resolve")
        return addresses[host]

    return EgressPolicy.from_allowlist(allow or [], resolver,
                                       proxy=Proxy(PROXY, PROXY, https_source="HTTPS_PROXY"))


def test_through_a_proxy_every_address_of_the_target_must_be_allowed() -> None:
    policy = _policy({"public.example": ["93.184.216.34"],
                      "split.example": ["93.184.216.34", "10.0.0.5"]})
    policy.check_through_proxy("public.example", 443, PROXY)
    with pytest.raises(EgressRefused, match=r"10\.0\.0\.5.*was not asked"):
        policy.check_through_proxy("split.example", 443, PROXY)
    with pytest.raises(EgressRefused, match="169.254.169.254"):
        policy.check_through_proxy("169.254.169.254", 80, PROXY)


def test_through_a_proxy_a_name_that_does_not_resolve_here_passes_only_when_allowlisted() -> None:
    with pytest.raises(EgressRefused, match="MODELPREP_EGRESS_ALLOWLIST.*") as refused:
        _policy({}).check_through_proxy("hub.corp", 443, PROXY)
    assert "the proxy http://proxy.internal:3128 (from HTTPS_PROXY)" in refused.value.message
    _policy({}, allow=["hub.corp"]).check_through_proxy("hub.corp", 443, PROXY)
