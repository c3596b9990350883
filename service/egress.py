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
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from service.errors import EgressRefused, InvalidRequest

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


@dataclass(frozen=True)
class EgressPolicy:
    """The allowlist, parsed once: host names (exact, case-insensitive) and networks."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IpNetwork, ...] = ()
    resolver: Resolver = system_resolver

    @classmethod
    def from_allowlist(
        cls, entries: Iterable[str], resolver: Resolver = system_resolver
    ) -> EgressPolicy:
        """Parse ``MODELPREP_EGRESS_ALLOWLIST`` entries: a CIDR or address, else a host name."""
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
        return cls(frozenset(hosts), tuple(networks), resolver)

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


class EgressTransport(httpx.BaseTransport):
    """An httpx transport that connects only where the policy allows, to the checked address.

    Every request (each redirect hop included, since the caller sends each hop) is resolved
    and rewritten to the allowed IP literal before it reaches the connection pool."""

    def __init__(self, policy: EgressPolicy, inner: httpx.BaseTransport | None = None) -> None:
        self._policy = policy
        self._inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        port = request.url.port or (443 if request.url.scheme == "https" else 80)
        address = self._policy.resolve(host, port)
        if _literal(host) is None:
            # Host header is already set from the URL; the TLS name must follow the host too.
            request.extensions = {**request.extensions, "sni_hostname": host}
            request.url = request.url.copy_with(host=address)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def egress_client(policy: EgressPolicy, timeout: httpx.Timeout) -> httpx.Client:
    """An ``httpx.Client`` whose every connection goes through :class:`EgressTransport`;
    redirects are not followed (each hop must be sent, hence checked, by the caller)."""
    return httpx.Client(transport=EgressTransport(policy), timeout=timeout,
                        follow_redirects=False)
