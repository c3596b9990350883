"""Scale-out end to end: one API process and two ``modelprep worker`` processes, separate OS
processes sharing a fresh PostgreSQL database and a data directory, running real tiny
checkpoints. Slow jobs download from a loopback HTTP server that trickles the weights, so there
is time to kill a worker, cancel, or restart the API while they run.

Heartbeats are fast here (0.5 s, stale after 4 s) so a dead worker is noticed within seconds;
the trickled downloads report no progress for longer than that, so they also pin down that a
quiet job is kept alive by its worker's heartbeat rather than retried.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.models import build_checkpoint
from tests.fixtures.postgres import fresh_database
from tests.fixtures.service import (
    ServiceProcess,
    WorkerProcess,
    running_service,
    running_worker,
)
from tests.fixtures.waiting import eventually

pytestmark = pytest.mark.postgres

FAST_HEARTBEATS = {
    "MODELPREP_EXECUTOR": "procrastinate",
    "MODELPREP_WORKERS": "2",
    "MODELPREP_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELPREP_HEARTBEAT_TIMEOUT_SECONDS": "4",
    "MODELPREP_WORKER_POLL_SECONDS": "0.5",
}
TRICKLE_BYTES_PER_SECOND = 40_000
"""The tiny llama's 360 KB of weights take about 9 s at this rate."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    return root


@pytest.fixture
def slow_source(root: Path) -> Iterator[str]:
    """The URL of the llama's weights, served slowly."""
    server = FileServer()
    try:
        yield server.add(
            "/llama/model.safetensors",
            Route(body=root / "llama" / "model.safetensors",
                  bytes_per_second=TRICKLE_BYTES_PER_SECOND),
        )
    finally:
        server.stop()


@dataclass
class Cluster:
    api: ServiceProcess
    workers: list[WorkerProcess]
    database_url: str
    data_dir: Path

    def submit(self, source: str) -> str:
        with self.api.client() as client:
            response = client.post(
                "/v1/jobs", json={"source": source, "exports": [{"format": "safetensors"}]}
            )
        assert response.status_code == 202, response.text
        job_id: str = response.json()["id"]
        return job_id

    def get(self, job_id: str) -> dict[str, Any]:
        with self.api.client() as client:
            job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        return job

    def wait_until(self, job_id: str, phase: str, timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["phase"] == phase and job["status"] == "running":
                return job
            assert job["status"] in ("queued", "running"), job
            assert time.monotonic() < deadline, f"{job_id} never reached {phase}:\n{self.logs()}"
            time.sleep(0.1)

    def row(self, job_id: str) -> dict[str, Any]:
        """Columns the API does not show (which worker, heartbeat)."""
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                row = conn.execute(
                    text("SELECT worker, heartbeat_at, attempts FROM jobs WHERE id = :id"),
                    {"id": job_id},
                ).mappings().one()
            return dict(row)
        finally:
            engine.dispose()

    def worker_of(self, job_id: str) -> WorkerProcess:
        pid = int(str(self.row(job_id)["worker"]).rsplit(":", 1)[1])
        return next(w for w in self.workers if w.pid == pid)

    def starts(self, job_id: str) -> list[dict[str, Any]]:
        """The "started" records of ``job_id`` in every worker's log: one per attempt."""
        records = []
        for worker in self.workers:
            for line in worker.logs().splitlines():
                if line.startswith("{"):
                    entry = json.loads(line)
                    if entry.get("msg") == "started" and entry.get("job_id") == job_id:
                        records.append(entry)
        return records

    def first_start(self, job_id: str) -> dict[str, Any]:
        """The one "started" record of ``job_id``, waited for: the job process writes it to its
        worker's log, which the job's phase in the store does not wait for."""
        records: list[dict[str, Any]] = eventually(
            lambda: self.starts(job_id), what=f"the 'started' record of {job_id}",
            context=self.logs,
        )
        assert len(records) == 1, records
        return records[0]

    def logs(self) -> str:
        return "\n".join(
            [self.api.logs()[-3000:]] + [w.logs()[-3000:] for w in self.workers]
        )

    def assert_one_set_of_artifacts(self, job: dict[str, Any]) -> None:
        job_dir = self.data_dir / "jobs" / job["id"]
        assert sorted(p.name for p in job_dir.iterdir()) == ["artifacts"]
        on_disk = sorted(
            p.relative_to(job_dir / "artifacts").as_posix()
            for p in (job_dir / "artifacts").rglob("*") if p.is_file()
        )
        assert on_disk == sorted(a["path"] for a in job["artifacts"])


@contextmanager
def cluster(tmp_path: Path, root: Path, workers: int = 2) -> Iterator[Cluster]:
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database())
        env = {**FAST_HEARTBEATS, "MODELPREP_DATABASE_URL": url}
        data = tmp_path / "data"
        api = stack.enter_context(running_service(data, [root], env=env))
        procs = [
            stack.enter_context(running_worker(data, url, [root], env=env, name=f"worker-{i}"))
            for i in range(workers)
        ]
        yield Cluster(api=api, workers=procs, database_url=url, data_dir=data)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_eight_jobs_on_two_workers_all_succeed_each_run_once(tmp_path: Path, root: Path) -> None:
    with cluster(tmp_path, root) as c:
        ids = [c.submit(f"file://{root / 'llama'}") for _ in range(8)]
        jobs = [c.api.wait_for(job_id, timeout=240) for job_id in ids]
        for job in jobs:
            assert job["status"] == "succeeded", job["error"]
            assert job["attempts"] == 1
            assert len(c.starts(job["id"])) == 1
            c.assert_one_set_of_artifacts(job)
        ran_on = {int(str(c.row(job_id)["worker"]).rsplit(":", 1)[1]) for job_id in ids}
        assert ran_on == {w.pid for w in c.workers}  # both workers took jobs


def test_a_job_whose_worker_is_killed_is_retried_on_the_other_with_one_set_of_artifacts(
    tmp_path: Path, root: Path, slow_source: str
) -> None:
    with cluster(tmp_path, root) as c:
        job_id = c.submit(slow_source)
        c.wait_until(job_id, "download")
        victim = c.worker_of(job_id)
        first = c.first_start(job_id)
        time.sleep(1.0)  # mid-download
        victim.kill()
        done = c.api.wait_for(job_id, timeout=120)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 2
        assert _gone(first["pid"]), "the killed worker's job process outlived it"
        survivor = next(w for w in c.workers if w is not victim)
        assert c.worker_of(job_id) is survivor
        # Logged after the job is handed back, so possibly after wait_for saw it succeed.
        survivor.wait_for_records(
            lambda e: e.get("msg") == "job's worker stopped heartbeating"
            and e.get("job_id") == job_id,
            what="the survivor's record of the lost worker",
        )
        c.assert_one_set_of_artifacts(done)


def test_a_worker_stopped_by_sigterm_hands_its_job_to_the_other(
    tmp_path: Path, root: Path, slow_source: str
) -> None:
    with cluster(tmp_path, root) as c:
        job_id = c.submit(slow_source)
        c.wait_until(job_id, "download")
        leaving = c.worker_of(job_id)
        first = c.first_start(job_id)
        leaving.stop()
        assert leaving.process.returncode == 0, leaving.logs()[-3000:]
        assert _gone(first["pid"])
        done = c.api.wait_for(job_id, timeout=120)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 2
        assert "released at shutdown" in leaving.logs()
        c.assert_one_set_of_artifacts(done)


def test_cancelling_a_job_running_on_a_worker_stops_it_within_five_seconds(
    tmp_path: Path, root: Path, slow_source: str
) -> None:
    with cluster(tmp_path, root) as c:
        job_id = c.submit(slow_source)
        c.wait_until(job_id, "download")
        start = c.first_start(job_id)
        asked = time.monotonic()
        with c.api.client() as client:
            assert client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202)
        done = c.api.wait_for(job_id, timeout=10)
        assert time.monotonic() - asked < 5.0
        assert done["status"] == "cancelled" and done["attempts"] == 1
        deadline = time.monotonic() + 5
        while not _gone(start["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(start["pid"])
        assert not (c.data_dir / "jobs" / job_id).exists()
        # the workers carry on
        assert c.api.wait_for(c.submit(f"file://{root / 'llama'}"))["status"] == "succeeded"


def test_restarting_the_api_mid_run_loses_nothing(
    tmp_path: Path, root: Path, slow_source: str
) -> None:
    with cluster(tmp_path, root) as c:
        port = int(c.api.url.rsplit(":", 1)[1])
        ids = [c.submit(slow_source), c.submit(slow_source)]
        ids += [c.submit(f"file://{root / 'llama'}") for _ in range(2)]
        c.wait_until(ids[0], "download")
        c.api.process.terminate()
        c.api.process.wait(timeout=30)
        env = {**FAST_HEARTBEATS, "MODELPREP_DATABASE_URL": c.database_url}
        with running_service(c.data_dir, [root], env=env, port=port) as again:
            for job_id in ids:
                done = again.wait_for(job_id, timeout=240)
                assert done["status"] == "succeeded", done["error"]
                assert done["attempts"] == 1


def test_a_job_past_its_timeout_is_killed_on_its_worker_and_fails_job_timeout(
    tmp_path: Path, root: Path, slow_source: str
) -> None:
    with cluster(tmp_path, root, workers=1) as c:
        with c.api.client() as client:
            response = client.post("/v1/jobs", json={
                "source": slow_source, "exports": [{"format": "safetensors"}], "timeout": 2})
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        # Not polled for its download phase: on a loaded machine the job can reach it and time
        # out between two polls. Its phases and its start record say it ran, after the fact.
        job = c.api.wait_for(job_id, timeout=60)
        assert job["status"] == "failed" and job["error"]["type"] == "job_timeout", job
        assert any(p["phase"] == "download" for p in job["phases"]), job["phases"]
        assert job["artifacts"] == []
        start = c.first_start(job_id)  # waited for: the worker's log lags the store
        deadline = time.monotonic() + 5
        while not _gone(start["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(start["pid"])
        assert not (c.data_dir / "jobs" / job_id / "artifacts").exists()


def test_identical_jobs_on_two_workers_compute_once_and_share_the_artifacts(
    tmp_path: Path, root: Path
) -> None:
    """Result reuse across workers: the settling lock lives in PostgreSQL. Four identical jobs
    submitted together run on both workers; exactly one runs the export phase, the others
    share its files (hard links in the shared data directory)."""
    with cluster(tmp_path, root) as c:
        ids = [c.submit(f"file://{root / 'llama'}") for _ in range(4)]
        jobs = [c.api.wait_for(job_id, timeout=240) for job_id in ids]
        assert all(j["status"] == "succeeded" for j in jobs), [j["error"] for j in jobs]
        ran = [j for j in jobs if any(p["phase"] == "export" for p in j["phases"])]
        assert len(ran) == 1, [(j["id"], j.get("reuse")) for j in jobs]
        for job in jobs:
            if job is ran[0]:
                assert job["reused_from"] is None
                continue
            # from the job that computed, or from one that already shares its files
            assert job["reused_from"] in set(ids) - {job["id"]}
            for artifact in job["artifacts"]:
                assert os.path.samefile(
                    c.data_dir / "jobs" / job["id"] / "artifacts" / artifact["path"],
                    c.data_dir / "jobs" / ran[0]["id"] / "artifacts" / artifact["path"],
                )
        assert len({int(str(c.row(j)["worker"]).rsplit(":", 1)[1]) for j in ids}) == 2
