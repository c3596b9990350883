"""Job lifecycle against a real server: cancel a running job, a job process killed by a signal,
the service killed and restarted mid-job. The running job is a real slow download from a
loopback HTTP server that trickles its bytes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.models import build_checkpoint
from tests.fixtures.service import ServiceProcess, running_service

SLOW = 20_000  # bytes per second: the weights file takes minutes to arrive
STARTED_S = 180.0
"""A deadline, not a bound: how long a new job may take to be seen downloading (its process
started, its imports done, its first request sent). Seconds when the machine is idle; two
workers of the suite and their jobs on two cores made 60 s too short once."""


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    ckpt = build_checkpoint(tmp_path_factory.mktemp("slow") / "llama", "llama", "safetensors")
    return (ckpt / "model.safetensors").read_bytes()


def job_processes(svc: ServiceProcess) -> list[psutil.Process]:
    """The service's job processes: each leads its own session."""
    children = psutil.Process(svc.process.pid).children(recursive=True)
    return [p for p in children if p.is_running() and os.getsid(p.pid) == p.pid]


def start_slow_job(svc: ServiceProcess, server: FileServer, weights: bytes) -> str:
    url = server.add("/slow/model.safetensors", Route(body=weights, bytes_per_second=SLOW))
    with svc.client() as client:
        response = client.post(
            "/v1/jobs", json={"source": url, "exports": [{"format": "safetensors"}]}
        )
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    deadline = time.monotonic() + STARTED_S
    with svc.client() as client:
        while time.monotonic() < deadline:
            job = client.get(f"/v1/jobs/{job_id}").json()
            requested = any(seen.path == "/slow/model.safetensors" for seen in server.seen)
            # The API's own header read at submission is a request too: the job is under way
            # once its process (the one leading its own session) is there as well.
            if job["phase"] == "download" and requested and len(job_processes(svc)) == 1:
                return job_id
            time.sleep(0.1)
    raise AssertionError(f"job never started downloading:\n{svc.logs()[-3000:]}")


def test_cancelling_a_running_job_stops_its_process_within_5s(
    tmp_path: Path, http_server: FileServer, weights: bytes
) -> None:
    with running_service(tmp_path / "data") as svc:
        job_id = start_slow_job(svc, http_server, weights)
        [process] = job_processes(svc)
        started = time.monotonic()
        with svc.client() as client:
            response = client.delete(f"/v1/jobs/{job_id}")
        assert response.status_code == 202
        job = svc.wait_for(job_id, timeout=5)
        assert time.monotonic() - started < 5
        assert job["status"] == "cancelled"
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        assert not (svc.data_dir / "jobs" / job_id).exists()
        with svc.client() as client:
            again = client.delete(f"/v1/jobs/{job_id}")
            assert again.status_code == 200  # finished: its (already removed) files go
            assert again.json()["deleted_at"]
            assert client.get("/readyz").status_code == 200


def test_a_killed_job_process_fails_only_that_job(
    tmp_path: Path, http_server: FileServer, weights: bytes
) -> None:
    root = tmp_path / "models"
    build_checkpoint(root / "llama", "llama", "safetensors")
    with running_service(tmp_path / "data", [root]) as svc:
        job_id = start_slow_job(svc, http_server, weights)
        [process] = job_processes(svc)
        process.send_signal(signal.SIGKILL)
        job = svc.wait_for(job_id, timeout=30)
        assert job["status"] == "failed"
        assert job["error"]["type"] == "worker_crashed"
        assert "SIGKILL" in job["error"]["message"]
        assert not (svc.data_dir / "jobs" / job_id / "artifacts").exists()
        with svc.client() as client:
            other = client.post("/v1/jobs", json={"source": f"file://{root / 'llama'}",
                                                  "exports": [{"format": "safetensors"}]})
        assert svc.wait_for(other.json()["id"])["status"] == "succeeded"


def test_a_job_interrupted_by_a_service_crash_is_requeued_and_finishes(
    tmp_path: Path, http_server: FileServer, weights: bytes
) -> None:
    data = tmp_path / "data"
    with running_service(data) as svc:
        job_id = start_slow_job(svc, http_server, weights)
        [process] = job_processes(svc)
        svc.process.send_signal(signal.SIGKILL)
        svc.process.wait()
        process.wait(timeout=10)  # dies with its service (PDEATHSIG), leaves no orphan writer
    # the source is fast now: the second attempt finishes
    http_server.add("/slow/model.safetensors", Route(body=weights))
    with running_service(data) as svc:
        job = svc.wait_for(job_id, timeout=120)
        assert job["status"] == "succeeded", job["error"]
        assert job["attempts"] == 2
        paths = [a["path"] for a in job["artifacts"]]
        assert paths.count("safetensors/model.safetensors") == 1
        assert not (data / "jobs" / job_id / "work").exists()
