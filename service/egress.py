"""Egress policy: where the service may open outbound connections on a user's behalf.

A job's HTTP source URL, every redirect it follows and a job's callback URL are chosen by the
caller, so without a policy the service is a proxy into its own network (server-side request
forgery: the cloud metadata service at 169.254.169.254, loopback admin ports, private hosts).

The rule: a host name is resolved, and only addresses that are *global* (not loopback,
link-local, private, shared, reserved, multicast...) are connected to, unless the host name or
the address is in ``MODELPREP_EGRESS_ALLOWLIST`` (a JSON list of host names and CIDRs, for an
internal mirror or the test suite's loopback servers).

DNS rebinding is defeated by connecting to the very address that was checked: the
:class:`EgressTransport` resolves once, checks, and sends the request to that IP literal, with
the original ``Host`` header and TLS server name (httpx's public ``sni_hostname`` extension), so
certificates are still verified against the host name. No second lookup can answer differently.

Proxies and private CAs (:class:`Proxy`, ``ca_bundle``; settings in service/config.py):
through a forward proxy (``MODELPREP_PROXY``, else ``HTTPS_PROXY`` / ``HTTP_PROXY``, bypassed
for ``NO_PROXY``) the target is checked before the proxy is asked, so the proxy never sees a
refused destination: every address the name resolves to here must be allowed (the proxy
resolves the name again and may pick any of them), and a name that does not resolve here passes
only when the allowlist names it. The tunnel names the host, not the checked address, as
proxies filter and log by name and TLS needs the name (httpcore's tunnel verifies the
certificate against the URL's host); what the proxy then resolves is the proxy's to police. The
CA bundle (``MODELPREP_CA_BUNDLE``, else ``SSL_CERT_FILE``, else ``REQUESTS_CA_BUNDLE``) is the
trust store of every TLS connection, as OpenSSL and requests read those variables; a certificate
it does not trust fails at once as :class:`~service.errors.CertificateUntrusted`, naming them.
The object store's and STS's requests are sent with a policy of their own CA bundle
(``MODELPREP_S3_CA_BUNDLE``, else ``AWS_CA_BUNDLE``, as the AWS SDKs read it, else that one:
``Settings.store_egress_policy``), whose refusals name those variables.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from service.errors import CertificateUntrusted, EgressRefused, InvalidRequest

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, in the order the system prefers them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise EgressRefused(f"host {host!r} does not resolve") from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _literal(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


CA_VARIABLES = "MODELPREP_CA_BUNDLE, SSL_CERT_FILE or REQUESTS_CA_BUNDLE"
"""The settings that name the CA bundle, in their order of precedence (for messages)."""


def without_userinfo(url: str) -> str:
    """``url`` as it may be logged: a proxy URL may carry ``user:password@``."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


@dataclass(frozen=True)
class Proxy:
    """The forward proxy of outbound connections: one URL per target scheme, and the hosts
    that bypass it (``NO_PROXY`` semantics: ``*``, host names, ``.domain`` suffixes)."""

    http: str | None = None
    """The proxy of ``http://`` targets."""
    https: str | None = None
    """The proxy of ``https://`` targets."""
    no_proxy: str = ""
    http_source: str = ""
    """The variable that set :attr:`http`, for messages (``MODELPREP_PROXY``, ``HTTP_PROXY``)."""
    https_source: str = ""
    """The variable that set :attr:`https`."""

    def for_target(self, scheme: str, host: str) -> str | None:
        """The proxy URL a connection to ``host`` goes through, None when it goes direct."""
        url = self.https if scheme == "https" else self.http
        if url is None or self.bypassed(host):
            return None
        return url

    def bypassed(self, host: str) -> bool:
        """Whether ``no_proxy`` names ``host``: ``*``; the host or a domain it is under
        (``example.com``, ``.example.com``, ``*.example.com``); an address or network it is in
        (``10.0.0.0/8``), as curl and obstore read ``NO_PROXY``. A ``:port`` is ignored."""
        name = host.strip("[]").lower().rstrip(".")
        address = _literal(name)
        for raw in self.no_proxy.split(","):
            entry = raw.strip().lower()
            if entry.count(":") == 1:
                entry = entry.partition(":")[0]
            entry = entry.strip("[]").lstrip("*").lstrip(".").rstrip(".")
            if raw.strip() == "*" or (entry and (name == entry or name.endswith("." + entry))):
                return True
            if address is not None and entry:
                try:
                    if address in ipaddress.ip_network(entry, strict=False):
                        return True
                except ValueError:
                    continue
        return False

    def describe(self, url: str) -> str:
        """``url`` (credentials removed) and where it comes from, for a message."""
        source = self.https_source if url == self.https else self.http_source
        return f"the proxy {without_userinfo(url)} (from {source})"


@cache
def _ssl_context(ca_bundle: Path | None) -> ssl.SSLContext:
    """The trust store of every TLS connection: the CA bundle when one is set, else certifi's
    (what httpx trusts by default). Cached: loading a bundle costs milliseconds per client."""
    if ca_bundle is not None:
        return ssl.create_default_context(cafile=str(ca_bundle))
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def untrusted_certificate(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind ``exc`` (httpx wraps httpcore's error,
    which wraps the ssl module's), None when it is another failure."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass(frozen=True)
class EgressPolicy:
    """The allowlist, parsed once: host names (exact, case-insensitive) and networks; and how
    connections leave: the proxy and the CA bundle."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IpNetwork, ...] = ()
    resolver: Resolver = system_resolver
    proxy: Proxy = field(default_factory=Proxy)
    ca_bundle: Path | None = None
    ca_source: str = ""
    """The variable that named ``ca_bundle``, for messages."""
    ca_variables: str = CA_VARIABLES
    """Every variable that chooses ``ca_bundle``, in order: what a refusal tells the operator
    to set."""

    @classmethod
    def from_allowlist(
        cls, entries: Iterable[str], resolver: Resolver = system_resolver, *,
        proxy: Proxy | None = None, ca_bundle: Path | None = None, ca_source: str = "",
        ca_variables: str = CA_VARIABLES,
    ) -> EgressPolicy:
        """Parse ``MODELPREP_EGRESS_ALLOWLIST`` entries: a CIDR or address, else a host name;
        the proxy and CA bundle are kept as they are."""
        hosts: set[str] = set()
        networks: list[IpNetwork] = []
        for entry in entries:
            value = entry.strip()
            if not value:
                raise InvalidRequest("empty entry in the egress allowlist")
            try:
                networks.append(ipaddress.ip_network(value, strict=False))
            except ValueError:
                hosts.add(value.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks), resolver, proxy or Proxy(), ca_bundle,
                   ca_source, ca_variables)

    def address_allowed(self, address: IpAddress) -> bool:
        """Global addresses, and those in an allowlisted network."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
        if any(address in net for net in self.networks):
            return True
        return address.is_global and not address.is_multicast

    def check_literal(self, url: str) -> None:
        """Submission-time check: refuse a URL whose host is a literal, refused address.

        A host name is left to the job (resolving at submission would only check a moment that
        does not matter: the job connects later, maybe elsewhere)."""
        host = urlsplit(url).hostname or ""
        if host.lower().rstrip(".") in self.hosts:
            return
        address = _literal(host)
        if address is not None and not self.address_allowed(address):
            raise EgressRefused(f"connections to {address} are not allowed by the egress policy")

    def resolve(self, host: str, port: int) -> str:
        """The address to connect to for ``host``: the first allowed one it resolves to.

        Raises EgressRefused when it resolves to refused addresses only."""
        allow_all = host.lower().rstrip(".") in self.hosts
        literal = _literal(host)
        candidates = [str(literal)] if literal is not None else self.resolver(host, port)
        for candidate in candidates:
            address = _literal(candidate)
            if address is not None and (allow_all or self.address_allowed(address)):
                return str(address)
        raise EgressRefused(
            f"host {host!r} resolves to {', '.join(candidates) or 'nothing'}, which the egress "
            "policy does not allow (non-global address; see MODELPREP_EGRESS_ALLOWLIST)"
        )

    def check_through_proxy(self, host: str, port: int, proxy: str) -> None:
        """A target reached through ``proxy``: every address ``host`` resolves to here must be
        allowed (the proxy picks one itself), unless the allowlist names the host. Raises
        EgressRefused before the proxy is asked."""
        if host.lower().rstrip(".") in self.hosts:
            return
        literal = _literal(host)
        try:
            candidates = [str(literal)] if literal is not None else self.resolver(host, port)
        except EgressRefused:
            raise EgressRefused(
                f"host {host!r} does not resolve here, so the egress policy cannot check it "
                f"before {self.proxy.describe(proxy)} is asked; name it in "
                "MODELPREP_EGRESS_ALLOWLIST to let the proxy resolve it"
            ) from None
        refused = [c for c in candidates
                   if (address := _literal(c)) is None or not self.address_allowed(address)]
        if refused or not candidates:
            raise EgressRefused(
                f"host {host!r} resolves to {', '.join(refused) or 'nothing'}, which the egress "
                f"policy does not allow (non-global address; see MODELPREP_EGRESS_ALLOWLIST); "
                f"{self.proxy.describe(proxy)} was not asked"
            )

    def ssl_context(self) -> ssl.SSLContext:
        """The context that verifies every TLS connection (see :attr:`ca_variables`)."""
        return _ssl_context(self.ca_bundle)

    def untrusted(self, host: str, exc: ssl.SSLCertVerificationError) -> CertificateUntrusted:
        """The typed error of a certificate of ``host`` that the trust store refused, naming
        the bundle in use and the variables that choose it."""
        trusted = (f"the CA bundle {self.ca_bundle} ({self.ca_source})"
                   if self.ca_bundle is not None else "certifi's public CA bundle")
        return CertificateUntrusted(
            f"the TLS certificate of {host} is not trusted by {trusted}: "
            f"{exc.verify_message or exc.reason}; name its CA's bundle in {self.ca_variables}"
        )


class EgressTransport(httpx.BaseTransport):
    """An httpx transport that connects only where the policy allows, to the checked address,
    directly or through the policy's proxy.

    Every request (each redirect hop included, since the caller sends each hop) is resolved
    and rewritten to the allowed IP literal before it reaches the connection pool; one that goes
    through the proxy is checked (:meth:`EgressPolicy.check_through_proxy`) and sent by name."""

    def __init__(
        self, policy: EgressPolicy, inner: httpx.BaseTransport | None = None,
        judged: bool = True,
    ) -> None:
        self._policy = policy
        self._inner = inner or httpx.HTTPTransport(verify=policy.ssl_context())
        self._proxied: dict[str, httpx.HTTPTransport] = {}
        self._judged = judged

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        port = request.url.port or (443 if request.url.scheme == "https" else 80)
        proxy = self._policy.proxy.for_target(request.url.scheme, host)
        if proxy is not None:
            if self._judged:
                self._policy.check_through_proxy(host, port, proxy)
            return self._send(request, host, self._through(proxy), proxy)
        if not self._judged:
            return self._send(request, host, self._inner, None)
        address = self._policy.resolve(host, port)
        if _literal(host) is None:
            # Host header is already set from the URL; the TLS name must follow the host too.
            request.extensions = {**request.extensions, "sni_hostname": host}
            request.url = request.url.copy_with(host=address)
        return self._send(request, host, self._inner, None)

    def _through(self, proxy: str) -> httpx.HTTPTransport:
        if proxy not in self._proxied:
            self._proxied[proxy] = httpx.HTTPTransport(
                proxy=proxy, verify=self._policy.ssl_context()
            )
        return self._proxied[proxy]

    def _send(
        self, request: httpx.Request, host: str, transport: httpx.BaseTransport,
        proxy: str | None,
    ) -> httpx.Response:
        """Send; a refused certificate becomes :class:`CertificateUntrusted` (another attempt
        would be refused too) and a failure to reach the target through the proxy names the
        proxy and its variable."""
        try:
            return transport.handle_request(request)
        except httpx.TransportError as exc:
            refused = untrusted_certificate(exc)
            if refused is not None:
                raise self._policy.untrusted(host, refused) from exc
            if proxy is not None and isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout
                                                | httpx.ProxyError):
                raise httpx.ProxyError(
                    f"{type(exc).__name__} reaching {host} through "
                    f"{self._policy.proxy.describe(proxy)}: {exc}"
                ) from exc
            raise

    def close(self) -> None:
        self._inner.close()
        for transport in self._proxied.values():
            transport.close()


def transport_failure(exc: BaseException) -> str:
    """What a message may say of a transport failure: its class name, and for a proxy failure
    the proxy (credentials removed) and its variable. Other messages may hold a URL with a
    presigned query, so they are left out."""
    if isinstance(exc, httpx.ProxyError):
        return f"{type(exc).__name__}: {exc}"
    return type(exc).__name__


def egress_client(
    policy: EgressPolicy, timeout: httpx.Timeout, judged: bool = True,
) -> httpx.Client:
    """An ``httpx.Client`` whose every connection goes through :class:`EgressTransport`;
    redirects are not followed (each hop must be sent, hence checked, by the caller).
    ``judged=False``: the proxy and CA bundle only, for an endpoint the operator chose and
    that is judged apart (the object store's, by ``service.objectstore.check_egress``)."""
    return httpx.Client(transport=EgressTransport(policy, judged=judged), timeout=timeout,
                        follow_redirects=False)
