"""Which keys a request to the store is made with: the credential chain.

Credentials, in order (read when a client is made, never at import):

1. the tenant's pair in ``MODELPREP_S3_CREDENTIALS`` (``{"tenant": {"access_key_id",
   "secret_access_key"}}``), so each tenant reaches only what its own key may;
2. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``;
3. web identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``: Kubernetes service
   accounts), exchanged for temporary keys by this service
   (service/objectstore/web_identity.py: its STS request obeys the egress policy, goes to the
   store's own STS, and the keys also sign the requests obstore cannot make), handed to obstore
   as its ``credential_provider``;
4. the rest of the chain ``object_store`` implements (ECS container credentials, the instance
   metadata service);
5. the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``, default
   ``~/.aws/credentials``, profile ``AWS_PROFILE`` or ``default``), which ``object_store`` does
   not read itself, used when the environment names neither keys nor a web identity.

A job's request never carries a key: ``s3://`` URIs with user info are refused. Keys are not
logged nor put in error messages (obstore's messages name the URL and status, never headers)."""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.config import Settings
from service.errors import AccessDenied
from service.objectstore.web_identity import web_identity_configured, web_identity_for

if TYPE_CHECKING:
    from obstore.store import S3Config


def _shared_file_credentials() -> S3Config | None:
    """Keys of the shared credentials file's profile, when the environment names no other
    source of credentials (the chain's order: environment and web identity first)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE") \
            or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") \
            or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return None
    path = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    if not path.is_file():
        return None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except configparser.Error:
        return None
    profile = env.get("AWS_PROFILE") or "default"
    if not parser.has_section(profile):
        return None
    section = parser[profile]
    key, secret = section.get("aws_access_key_id"), section.get("aws_secret_access_key")
    if not key or not secret:
        return None
    found: S3Config = {"access_key_id": key, "secret_access_key": secret}
    if section.get("aws_session_token"):
        found["session_token"] = section["aws_session_token"]
    return found

def _uses_web_identity(settings: Settings) -> bool:
    """Web identity is the chain's choice: configured, and no key pair in the environment
    (which comes first, as in the AWS SDKs)."""
    return web_identity_configured(settings) and not os.environ.get("AWS_ACCESS_KEY_ID")

def presign_seconds(settings: Settings, tenant: str | None, wanted: int) -> int:
    """How long a URL presigned now for ``tenant`` may be valid: ``wanted``, unless it is
    signed with web identity's temporary keys that expire sooner (a URL dies with its keys)."""
    own = settings.s3_credentials.get(tenant) if tenant is not None else None
    if own is None and _uses_web_identity(settings):
        return web_identity_for(settings).url_seconds(wanted)
    return wanted

@dataclass(frozen=True)
class StaticCredentials:
    """A key pair (and session token) this process holds itself, to sign requests obstore
    cannot make."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

def static_credentials(settings: Settings, tenant: str | None) -> StaticCredentials:
    """The keys :func:`store_for` would use, now: the tenant's, the environment's, web
    identity's temporary ones (with their session token; valid for minutes at least, so ask
    again for each request), or the shared file's. Container and instance credentials are
    resolved inside object_store, out of reach: copying a > 5 GB object then fails typed
    (:class:`AccessDenied`, naming the reason), never by moving the bytes through here."""
    entry = settings.s3_credentials.get(tenant) if tenant is not None else None
    if entry is not None:
        return StaticCredentials(
            entry.access_key_id, entry.secret_access_key.get_secret_value(),
            entry.session_token.get_secret_value() if entry.session_token else None,
        )
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return StaticCredentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                 env.get("AWS_SESSION_TOKEN") or None)
    if _uses_web_identity(settings):
        found = web_identity_for(settings).current()
        return StaticCredentials(found.access_key_id, found.secret_access_key,
                                 found.session_token)
    shared = _shared_file_credentials()
    if shared is not None:
        return StaticCredentials(shared["access_key_id"], shared["secret_access_key"],
                                 shared.get("session_token"))
    raise AccessDenied(
        "copying an object larger than 5 GB needs a key pair (tenant, AWS_* environment, web "
        "identity or shared credentials file); instance credentials cannot sign it here"
    )
