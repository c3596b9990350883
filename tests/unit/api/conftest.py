"""The API in process: the app ``modelprep serve`` builds (``create_app``), on a real SQLite
store under ``tmp_path``, driven through FastAPI's ``TestClient``.

The app's lifespan is not entered, so neither the job dispatcher nor the callback deliverer
starts: a submitted job stays queued until a test moves it on through the store, as a worker
records it (:func:`succeed`). What runs a job is tested in tests/unit/jobs and tests/e2e; these
tests pin the HTTP contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.auth import key_digest, new_key
from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact, JobStatus
from service.jobs.store import JobStore

PROBLEM = "application/problem+json"

KEYS = {"a": new_key(), "b": new_key(), "admin": new_key()}
"""Two tenants and an admin (tenant ``ops``)."""


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def key_entries() -> list[dict[str, Any]]:
    return [
        {"tenant": "a", "sha256": key_digest(KEYS["a"])},
        {"tenant": "b", "sha256": key_digest(KEYS["b"])},
        {"tenant": "ops", "sha256": key_digest(KEYS["admin"]), "admin": True},
    ]


AppFactory = Callable[..., FastAPI]


@pytest.fixture
def make_app(tmp_path: Path, llama_safetensors_dir: Path) -> Iterator[AppFactory]:
    """``make_app(**settings)`` -> the app with the three keys, the tiny checkpoints' directory
    as its local root, and its store's schema created."""
    stores: list[JobStore] = []

    def make(**overrides: Any) -> FastAPI:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "local_roots": [llama_safetensors_dir.parent],
            "api_keys": key_entries(),
            **overrides,
        }
        app = create_app(Settings(**values))
        app.state.jobs.store.create_schema()
        stores.append(app.state.jobs.store)
        return app

    yield make
    for store in stores:
        store.dispose()


@pytest.fixture
def app(make_app: AppFactory) -> FastAPI:
    return make_app()


@pytest.fixture
def client(app: FastAPI) -> TestClient:
    return TestClient(app)


@pytest.fixture
def llama_job(llama_safetensors_dir: Path) -> dict[str, Any]:
    """A valid body: the tiny Llama to safetensors."""
    return {"source": llama_safetensors_dir.as_uri(), "exports": [{"format": "safetensors"}]}


def submit(client: TestClient, body: dict[str, Any], who: str = "a") -> dict[str, Any]:
    response = client.post("/v1/jobs", json=body, headers=auth(who))
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def succeed(app: FastAPI, job_id: str, files: dict[str, bytes]) -> None:
    """Run a queued job to success as a worker records it: claimed, its artifacts written to
    the job's directory, finished with their sizes and digests."""
    store: JobStore = app.state.jobs.store
    assert store.claim(job_id, "test-worker") is not None
    layout = JobLayout.for_job(app.state.settings, job_id)
    artifacts = []
    for name, data in files.items():
        path = layout.artifacts / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        artifacts.append(Artifact(name, len(data), hashlib.sha256(data).hexdigest()))
    assert store.finish(job_id, JobStatus.SUCCEEDED, artifacts=artifacts)


def assert_problem(response: Any, status: int, code: str) -> dict[str, Any]:
    """``response`` is an RFC 9457 problem of ``status`` whose type ends with ``code``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status
    assert problem["type"] == f"/problems/{code}"  # a page the service itself serves
    assert problem["title"] and problem["detail"]
    return problem
