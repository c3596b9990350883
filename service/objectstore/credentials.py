"""Which keys a request to the store is made with: the credential chain.

Credentials, in order (read when a client is made, never at import):

1. the tenant's pair in ``MODELPREP_S3_CREDENTIALS`` (``{"tenant": {"access_key_id",
   "secret_access_key"}}``), so each tenant reaches only what its own key may;
2. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``;
3. web identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``: Kubernetes service
   accounts), exchanged for temporary keys by this service
   (service/objectstore/web_identity.py: its STS request obeys the egress policy and goes to
   the store's own STS), handed to obstore as its ``credential_provider``;
4. the rest of the AWS SDKs' chain, resolved by botocore as every SDK does
   (service/objectstore/aws.py): the shared credentials and config files of ``AWS_PROFILE``
   (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``; ``credential_process`` and assumed
   roles included), then container and instance credentials. Temporary ones reach obstore
   through a ``credential_provider`` that asks botocore, which renews them.

Every source's keys also sign the requests botocore's S3 client makes (UploadPartCopy,
ListMultipartUploads, AbortMultipartUpload): :func:`static_credentials`. A job's request never
carries a key: ``s3://`` URIs with user info are refused. Keys are not logged nor put in error
messages (obstore's messages name the URL and status, never headers)."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from botocore.credentials import RefreshableCredentials
from botocore.exceptions import BotoCoreError

from service.config import Settings
from service.errors import AccessDenied
from service.objectstore.aws import StaticCredentials, local_source, sdk_credentials
from service.objectstore.web_identity import (
    WebIdentityCredentials,
    web_identity_configured,
    web_identity_for,
)

if TYPE_CHECKING:
    from botocore.credentials import Credentials
    from obstore.store import S3Config, S3Credential

SDK_ASK_EVERY = timedelta(minutes=1)
"""How often obstore asks for temporary keys of the SDK chain again (botocore answers from its
cache until they are due for renewal): obstore asks 5 minutes before the expiry it is given."""


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


def _sdk(settings: Settings) -> Credentials:
    """The SDK chain's credentials; AccessDenied naming the sources when none has any."""
    try:
        found = sdk_credentials(settings)
    except BotoCoreError as exc:  # a profile that names a missing one, a failing process...
        raise AccessDenied(f"no object-store credentials: {exc}") from None
    if found is None:
        raise AccessDenied(
            "no object-store credentials: no tenant key (MODELPREP_S3_CREDENTIALS), no "
            "AWS_ACCESS_KEY_ID, no web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN), "
            f"nothing in profile {settings.aws_profile or 'default'} of the shared files, no "
            "container or instance credentials"
        )
    return found


def static_credentials(settings: Settings, tenant: str | None) -> StaticCredentials:
    """The keys :func:`store_for` would use, now: the tenant's, the environment's, web
    identity's temporary ones (with their session token; valid for minutes at least, so ask
    again for each request), or those of the rest of the SDK chain."""
    entry = settings.s3_credentials.get(tenant) if tenant is not None else None
    if entry is not None:
        return StaticCredentials(
            entry.access_key_id, entry.secret_access_key.get_secret_value(),
            entry.session_token.get_secret_value() if entry.session_token else None,
        )
    if _uses_web_identity(settings):
        found = web_identity_for(settings).current()
        return StaticCredentials(found.access_key_id, found.secret_access_key,
                                 found.session_token)
    frozen = _sdk(settings).get_frozen_credentials()
    return StaticCredentials(frozen.access_key, frozen.secret_key, frozen.token or None)


class _SdkKeys:
    """obstore's ``credential_provider`` for temporary keys of the SDK chain (an assumed
    role, container or instance credentials): botocore renews them; obstore asks again every
    :data:`SDK_ASK_EVERY`."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    def __call__(self) -> S3Credential:
        frozen = self._credentials.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(UTC) + SDK_ASK_EVERY + timedelta(minutes=5),
        }


def obstore_credentials(
    settings: Settings, tenant: str | None,
) -> tuple[S3Config, WebIdentityCredentials | _SdkKeys | None]:
    """What obstore is given: keys in its config, or a ``credential_provider`` for keys that
    expire. Fails typed (AccessDenied, or the STS unreachable) before any request."""
    entry = settings.s3_credentials.get(tenant) if tenant is not None else None
    if entry is not None:
        config: S3Config = {"access_key_id": entry.access_key_id,
                            "secret_access_key": entry.secret_access_key.get_secret_value()}
        if entry.session_token is not None:
            config["session_token"] = entry.session_token.get_secret_value()
        return config, None
    if _uses_web_identity(settings):
        provider = web_identity_for(settings)
        provider.current()  # STS refusing or unreachable fails here, typed, before any request
        return {}, provider
    found = _sdk(settings)
    if isinstance(found, RefreshableCredentials):
        return {}, _SdkKeys(found)
    frozen = found.get_frozen_credentials()
    config = {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key}
    if frozen.token:
        config["session_token"] = frozen.token
    return config, None


def credential_source(settings: Settings) -> dict[str, dict[str, str]]:
    """Which credentials a request would be signed with, named and never shown, without asking
    the network: the tenants with keys of their own, and the chain's source for the others
    (start-up's log line and ``/readyz``, beside :meth:`Settings.outbound`)."""
    tenants = sorted(settings.s3_credentials)
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        chain = {"value": "environment keys", "source": "AWS_ACCESS_KEY_ID"}
    elif web_identity_configured(settings):
        chain = {"value": f"web identity: role {settings.s3_role_arn}",
                 "source": "AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN"}
    elif (method := local_source(settings)) is not None:
        files = "AWS_SHARED_CREDENTIALS_FILE" if method == "shared-credentials-file" \
            else "AWS_CONFIG_FILE"
        chain = {"value": f"profile {settings.aws_profile or 'default'} ({method})",
                 "source": f"{'AWS_PROFILE, ' if settings.aws_profile else ''}{files}"}
    else:
        chain = {"value": "the SDK chain's other sources (assumed role, process, SSO, container "
                 "or instance credentials), resolved at first use", "source": "default"}
    return {
        "s3_tenant_keys": {"value": ", ".join(tenants) or "none",
                           "source": "MODELPREP_S3_CREDENTIALS" if tenants else "default"},
        "s3_credentials": chain,
    }


def outbound_report(settings: Settings) -> dict[str, dict[str, str]]:
    """:meth:`Settings.outbound` with the object store's :func:`credential_source`: what
    start-up logs and ``/readyz`` shows."""
    return {**settings.outbound(), **credential_source(settings)}
