"""What JobService.submit (the domain) accepts as a job's callback, on a real SQLite store:
refused at once (422, nothing queued) when it could not be signed, may not be reached or is no
URL of a receiver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from service.api.errors import http_status
from service.config import Settings
from service.errors import CallbackNotConfigured, EgressRefused
from service.jobs.executors.local import LocalExecutor
from service.jobs.model import CallbackState
from service.jobs.service import JobService
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore

TENANT_SECRET = "tenant-a-callback-secret-0123456789"


def service(store: JobStore, base: Settings, **changes: Any) -> JobService:
    """A JobService with a real executor that is not started: submit only queues."""
    settings = base.model_copy(update=changes)
    return JobService(settings=settings, store=store, executor=LocalExecutor(settings, store))


def spec(checkpoint: Path, url: str) -> JobSpec:
    return JobSpec.model_validate({
        "source": f"file://{checkpoint}", "exports": [{"format": "safetensors"}],
        "callback": {"url": url},
    })


def test_open_mode_without_a_service_secret_refuses_a_callback(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    with pytest.raises(CallbackNotConfigured, match="MODELPREP_CALLBACK_SECRET") as refused:
        service(store, base).submit(spec(llama_safetensors_dir, "https://hooks.example.com/x"))
    assert http_status(refused.value) == 422
    assert store.next_queued(10) == []


def test_a_tenant_without_its_own_key_is_refused_even_if_others_have_one(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    jobs = service(store, base, callback_secrets={"a": SecretStr(TENANT_SECRET)},
                   callback_secret=SecretStr("open-mode-secret-0123456789"))
    with pytest.raises(CallbackNotConfigured, match="tenant b"):
        jobs.submit(spec(llama_safetensors_dir, "https://hooks.example.com/x"), tenant="b")
    job = jobs.submit(spec(llama_safetensors_dir, "https://hooks.example.com/x"), tenant="a")
    assert job.callback is not None and job.callback.state is CallbackState.WAITING
    assert store.get(job.id).callback == job.callback


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata
    "http://127.0.0.1:8080/hook",
    "http://10.1.2.3/hook",
    "http://[::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
])
def test_a_literal_non_global_address_is_refused_at_submission(
    store: JobStore, base: Settings, llama_safetensors_dir: Path, url: str
) -> None:
    jobs = service(store, base, callback_secret=SecretStr("open-mode-secret-0123456789"))
    with pytest.raises(EgressRefused) as refused:
        jobs.submit(spec(llama_safetensors_dir, url))
    assert http_status(refused.value) == 422
    assert store.next_queued(10) == []


def test_the_allowlist_lets_a_literal_address_through(
    store: JobStore, base: Settings, llama_safetensors_dir: Path
) -> None:
    jobs = service(store, base, callback_secret=SecretStr("open-mode-secret-0123456789"),
                   egress_allowlist=["10.0.0.0/8"])
    assert jobs.submit(spec(llama_safetensors_dir, "http://10.1.2.3/hook")).callback is not None


@pytest.mark.parametrize("url", [
    "ftp://example.com/hook", "https://user:pw@example.com/hook", "not a url",
    "https:///no-host", "https://example.com:99999/", "https://example.com/hook#frag", "",
    "http://exa\x00mple.com/hook",
])
def test_a_callback_url_must_be_a_plain_http_url(url: str) -> None:
    with pytest.raises(ValidationError):
        spec(Path("/models/llama"), url)


def test_a_weak_callback_secret_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="at least 16"):
        Settings.model_validate({"data_dir": tmp_path, "callback_secret": "short"})
    with pytest.raises(ValidationError, match="at least 16"):
        Settings.model_validate({"data_dir": tmp_path, "callback_secrets": {"a": "short"}})
