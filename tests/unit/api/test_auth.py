"""API keys: parsing the configured digests, authenticating, and the open-mode binding rule."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.api.auth import (
    ANONYMOUS,
    Keyring,
    Principal,
    check_binding,
    is_loopback,
    key_digest,
    keygen_line,
    new_key,
)
from service.config import Settings
from service.errors import ConfigurationError, Unauthorized


def settings(tmp_path: Path, **kwargs: object) -> Settings:
    return Settings(data_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


def test_a_generated_key_authenticates_as_its_tenant(tmp_path: Path) -> None:
    key, entry = keygen_line("acme", admin=False)
    assert key.startswith("mp_") and len(key) > 40
    assert key not in entry
    keyring = Keyring.from_settings(settings(tmp_path, api_keys=[json.loads(entry)]))
    assert keyring.authenticate(key) == Principal(tenant="acme", admin=False)
    assert Principal("acme", admin=False).scope == "acme"
    assert Principal("ops", admin=True).scope is None


@pytest.mark.parametrize("presented", [None, "", "mp_wrong", "MP_" + "x" * 40])
def test_missing_or_unknown_keys_are_unauthorized(tmp_path: Path, presented: str | None) -> None:
    key = new_key()
    keyring = Keyring.from_settings(
        settings(tmp_path, api_keys=[{"tenant": "t", "sha256": key_digest(key)}])
    )
    with pytest.raises(Unauthorized):
        keyring.authenticate(presented)


def test_keys_file_adds_to_the_setting_and_errors_are_configuration_errors(tmp_path: Path) -> None:
    file = tmp_path / "keys.json"
    file.write_text(json.dumps([{"tenant": "b", "sha256": key_digest("kb"), "admin": True}]))
    keyring = Keyring.from_settings(settings(
        tmp_path, api_keys=[{"tenant": "a", "sha256": key_digest("ka")}], api_keys_file=file
    ))
    assert keyring.authenticate("ka").tenant == "a"
    assert keyring.authenticate("kb").admin
    file.write_text("not json")
    with pytest.raises(ConfigurationError, match="keys.json is unusable"):
        Keyring.from_settings(settings(tmp_path, api_keys_file=file))
    with pytest.raises(ConfigurationError, match="unusable"):
        Keyring.from_settings(settings(tmp_path, api_keys_file=tmp_path / "missing.json"))


def test_one_digest_for_two_tenants_is_refused(tmp_path: Path) -> None:
    digest = key_digest("shared")
    with pytest.raises(ConfigurationError, match="two tenants"):
        Keyring.from_settings(settings(tmp_path, api_keys=[
            {"tenant": "a", "sha256": digest}, {"tenant": "b", "sha256": digest}
        ]))


@pytest.mark.parametrize(
    "entry",
    [{"tenant": "a", "sha256": "abc"}, {"tenant": "a b", "sha256": "0" * 64},
     {"tenant": "a", "sha256": "A" * 64}, {"tenant": "x" * 65, "sha256": "0" * 64}],
)
def test_malformed_key_entries_fail_settings_validation(tmp_path: Path, entry: object) -> None:
    with pytest.raises(ValidationError):
        settings(tmp_path, api_keys=[entry])


def test_no_keys_means_an_open_service_of_anonymous_admins(tmp_path: Path) -> None:
    keyring = Keyring.from_settings(settings(tmp_path))
    assert keyring.open and keyring.authenticate(None) is ANONYMOUS


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
     ("example.com", False)],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_open_mode_warns_on_loopback_and_refuses_elsewhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keyring = Keyring.from_settings(settings(tmp_path))
    with caplog.at_level(logging.WARNING, logger="service.api.auth"):
        check_binding(keyring, "127.0.0.1")
    assert any(r.levelno == logging.WARNING and "NO API KEYS" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigurationError, match="refusing to serve on 0.0.0.0"):
        check_binding(keyring, "0.0.0.0")
    closed = Keyring.from_settings(
        settings(tmp_path, api_keys=[{"tenant": "a", "sha256": key_digest("k")}])
    )
    check_binding(closed, "0.0.0.0")  # keys configured: any address
