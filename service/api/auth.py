"""API keys and tenants: who is calling, and which jobs they may see.

A request carries ``Authorization: Bearer <key>``. The service knows keys only by their sha256
(``MODELPREP_API_KEYS`` or ``MODELPREP_API_KEYS_FILE``); each belongs to a tenant, and an admin
key sees every tenant's jobs. Keys are 256-bit random strings (``modelprep keygen``), so a plain
sha256 is safe to store: there is nothing to brute-force, which is what slow hashes protect.

With no key configured the service is open (every caller is an anonymous admin); that is only
allowed on a loopback address (:func:`check_binding`) and announced by a WARNING at start-up.

Routes never look at headers: they take a :data:`PrincipalDep` and pass ``principal.scope`` (the
tenant to filter on, None for admins) to the domain, which answers another tenant's job with
404 exactly like a job that does not exist.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import TypeAdapter, ValidationError

from service.config import ApiKeyEntry, Settings
from service.errors import ConfigurationError, Forbidden, Unauthorized

log = logging.getLogger(__name__)

KEY_PREFIX = "mp_"


@dataclass(frozen=True)
class Principal:
    """The caller of one request."""

    tenant: str | None
    """The tenant the caller's jobs are recorded under; None in open mode."""
    admin: bool

    @property
    def scope(self) -> str | None:
        """The tenant to filter jobs on: None (every job) for an admin."""
        return None if self.admin else self.tenant


ANONYMOUS = Principal(tenant=None, admin=True)


def key_digest(key: str) -> str:
    """The sha256 hex under which a key is configured."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key: 256 random bits, prefixed so it is recognisable in a secret scanner."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


_ENTRIES = TypeAdapter(list[ApiKeyEntry])


@dataclass(frozen=True)
class Keyring:
    """The configured keys, by digest. Built once by the app factory."""

    by_digest: dict[str, Principal]

    @classmethod
    def from_settings(cls, settings: Settings) -> Keyring:
        entries = list(settings.api_keys)
        if settings.api_keys_file is not None:
            try:
                entries += _ENTRIES.validate_json(settings.api_keys_file.read_bytes())
            except (OSError, ValidationError) as exc:
                raise ConfigurationError(
                    f"API keys file {settings.api_keys_file} is unusable: {exc}"
                ) from exc
        by_digest: dict[str, Principal] = {}
        for entry in entries:
            principal = Principal(tenant=entry.tenant, admin=entry.admin)
            if by_digest.setdefault(entry.sha256, principal) != principal:
                raise ConfigurationError(f"one key digest is configured for two tenants "
                                         f"({by_digest[entry.sha256].tenant}, {entry.tenant})")
        return cls(by_digest)

    @property
    def open(self) -> bool:
        """No key configured: every request is an anonymous admin."""
        return not self.by_digest

    def authenticate(self, key: str | None) -> Principal:
        """The principal of ``key``; Unauthorized when missing or unknown.

        A dict lookup by digest, not a comparison with each secret: timing can only reveal
        something about a hash of the key, which does not help guess the key."""
        if self.open:
            return ANONYMOUS
        if not key:
            raise Unauthorized("an API key is required: Authorization: Bearer <key>")
        principal = self.by_digest.get(key_digest(key))
        if principal is None:
            raise Unauthorized("the API key is not valid")
        return principal


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the service to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(keyring: Keyring, host: str) -> None:
    """Refuse an open service on a non-loopback address; warn loudly about an open one."""
    if not keyring.open:
        log.info("API keys configured", extra={"keys": len(keyring.by_digest)})
        return
    if not is_loopback(host):
        raise ConfigurationError(
            f"refusing to serve on {host} without API keys: anyone who can reach it could run "
            "and read jobs. Create a key with `modelprep keygen --tenant NAME` and set "
            "MODELPREP_API_KEYS (or MODELPREP_API_KEYS_FILE), or bind 127.0.0.1."
        )
    log.warning(
        "NO API KEYS CONFIGURED: the service is OPEN to every local process (loopback only). "
        "Set MODELPREP_API_KEYS or MODELPREP_API_KEYS_FILE before exposing it."
    )


def keygen_line(tenant: str, admin: bool) -> tuple[str, str]:
    """A new key and the JSON entry that configures it (a MODELPREP_API_KEYS list item)."""
    entry = ApiKeyEntry(tenant=tenant, sha256="0" * 64, admin=admin)  # validates the tenant
    key = new_key()
    entry = entry.model_copy(update={"sha256": key_digest(key)})
    return key, json.dumps(entry.model_dump())


_bearer = HTTPBearer(auto_error=False, description="An API key made by `modelprep keygen`.")

# The dependencies below are ``async`` although they never await: FastAPI runs a sync
# dependency in the thread pool, and a thread hop per dependency per request was the largest
# cost of a status poll under load (bench/api_latency.py).


async def _principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    keyring: Keyring = request.app.state.keyring
    principal = keyring.authenticate(credentials.credentials if credentials else None)
    request.state.principal = principal  # for the access log
    return principal


async def _admin(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
    if not principal.admin:
        raise Forbidden("this endpoint needs an admin key")
    return principal


PrincipalDep = Annotated[Principal, Depends(_principal)]
"""The authenticated caller; any route that takes it answers 401 without a valid key."""

KEY_REQUIRED = Depends(_principal)
"""For ``include_router(dependencies=[...])``: the same check, for a whole router."""

AdminDep = Annotated[Principal, Depends(_admin)]
"""An admin caller; 403 for a tenant key."""


async def _scraper(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal | None:
    settings: Settings = request.app.state.settings
    if settings.metrics_open:
        return None
    principal = await _principal(request, credentials)
    if not principal.admin:
        raise Forbidden("/metrics needs an admin key (or MODELPREP_METRICS_OPEN=true)")
    return principal


ScraperDep = Annotated[Principal | None, Depends(_scraper)]
"""Who may scrape /metrics: anyone with ``metrics_open``, else admins."""
