"""The image and the compose stack, built and run for real: a Docker engine, the Dockerfile, the
docker-compose.yml a user runs (API, two workers, PostgreSQL), jobs submitted with an API key,
a worker killed mid-job, the job's one set of artifacts, every container's health, teardown.

Base images come from the local image store; where no registry answers they are built from
Debian packages first (scripts/container_base_images.sh). Torch comes from this machine's local
wheel directory when it has one (served to the build on loopback), else from the CPU index.
Run with ``make container-test``; ``.ci/run`` runs it when a Docker engine starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from service.api.auth import keygen_line
from tests.fixtures.models import save_checkpoint, tiny_llama_config
from tests.fixtures.real_models import real_model
from tests.fixtures.service import free_port

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "modelprep-ct"
IMAGE = "modelprep:latest"
LOCAL_WHEELS = Path("/opt/wheels")
EXTRA_CA = Path("/usr/local/share/ca-certificates")
HEARTBEAT_TIMEOUT = 20


def run(*cmd: str, timeout: float = 600, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, env=env, check=False,
        cwd=ROOT,
    )
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(cmd[:4])} ... exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def wait_until(what: str, deadline_s: float, probe: Any, every: float = 1.0) -> Any:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {deadline_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def docker() -> None:
    if shutil.which("docker") is None or run("docker", "info", check=False).returncode != 0:
        pytest.fail("no Docker engine answers (`make container-test` installs and starts one)")
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (apt-get install docker-compose)")


@pytest.fixture(scope="module")
def wheel_server() -> Iterator[str | None]:
    """This machine's local wheels over HTTP on loopback, for pip inside the build."""
    if not LOCAL_WHEELS.is_dir():
        yield None
        return
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=LOCAL_WHEELS, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            return False

    try:
        wait_until("the wheel server", 30, answers, every=0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def image(docker: None, wheel_server: str | None) -> str:
    run(str(ROOT / "scripts" / "container_base_images.sh"), timeout=1200)
    args = ["docker", "build", "--network", "host", "-t", IMAGE]
    if wheel_server:
        args += ["--build-arg", f"TORCH_PIP_ARGS=--find-links {wheel_server}"]
    pems = sorted(EXTRA_CA.glob("*.crt")) if EXTRA_CA.is_dir() else []
    if pems:  # a TLS-inspecting proxy between this machine and the package index
        pem = "\n".join(p.read_text().strip() for p in pems)
        args += ["--build-arg", f"PIP_CA_PEM={pem}"]
    started = time.monotonic()
    run("nice", "-n", "10", *args, str(ROOT), timeout=1800)
    print(f"image build: {time.monotonic() - started:.0f}s", file=sys.stderr)
    return IMAGE


def test_image_is_slim_and_runs_as_uid_1000(image: str) -> None:
    out = run("docker", "run", "--rm", image, "sh", "-c",
              "id -u; command -v git || echo no-git; ls -d /src /app 2>/dev/null || echo clean; "
              "pip list 2>/dev/null | grep -ci egg-info || true").stdout.split()
    assert out[:3] == ["1000", "no-git", "clean"], out
    size = json.loads(run("docker", "image", "inspect", image).stdout)[0]["Size"]
    print(f"image size: {size / 1e9:.2f} GB", file=sys.stderr)


def test_root_owned_data_mount_stops_with_one_line_naming_path_and_fix(image: str) -> None:
    data = Path(tempfile.mkdtemp(prefix="modelprep-ct-data-"))
    try:
        data.chmod(0o755)  # root-owned, as a host directory created by root would be
        result = run("docker", "run", "--rm", "-v", f"{data}:/data", image,
                     "modelprep", "worker", check=False, timeout=120)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("modelprep worker: /data"), result.stderr
        assert "chown -R 1000:1000" in lines[-1] and "Traceback" not in result.stderr
    finally:
        shutil.rmtree(data)


@dataclass
class Stack:
    env: dict[str, str]
    url: str
    key: str
    models: Path

    def compose(self, *args: str, check: bool = True,
                timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run("docker-compose", "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"),
                   *args, env=self.env, check=check, timeout=timeout)

    def containers(self) -> list[str]:
        return self.compose("ps", "-q").stdout.split()

    def health(self) -> dict[str, str]:
        out = {}
        for cid in self.containers():
            state = json.loads(run("docker", "inspect", cid).stdout)[0]["State"]
            out[cid[:12]] = state.get("Health", {}).get("Status", state["Status"])
        return out

    def all_healthy(self) -> bool:
        health = self.health()
        return len(health) == 4 and set(health.values()) == {"healthy"}

    def job_worker(self, job_id: str) -> str:
        """Who runs the job (``host:pid``), read from PostgreSQL in its container."""
        return self.compose(
            "exec", "-T", "postgres", "psql", "-U", "modelprep", "-d", "modelprep", "-tAc",
            f"select worker from jobs where id = '{job_id}'",
        ).stdout.strip()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.key}"},
                            timeout=30)


def write_model(models: Path) -> Path:
    """A Llama checkpoint big enough (~70M parameters) that its job runs for a while, and the
    real SmolLM2-135M (with its tokenizer) for the job that runs llama.cpp in the image."""
    config = LlamaConfig(**{**tiny_llama_config().to_dict(), "hidden_size": 768,
                            "intermediate_size": 2048, "num_hidden_layers": 8,
                            "num_attention_heads": 12, "num_key_value_heads": 4})
    model = LlamaForCausalLM(config)
    out = save_checkpoint(model, models / "llama", "safetensors")
    shutil.copytree(real_model("smollm2"), models / "smollm2")
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the containers read as uid 1000
    return out


@pytest.fixture(scope="module")
def stack(image: str) -> Iterator[Stack]:
    models = Path(tempfile.mkdtemp(prefix="modelprep-ct-models-"))
    write_model(models)
    key, entry = keygen_line("ct", admin=False)
    port = free_port()
    env = {**os.environ, "MODELPREP_API_KEYS": f"[{entry}]", "MODELPREP_PORT": str(port),
           "MODELPREP_MODELS_DIR": str(models),
           "MODELPREP_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT)}
    s = Stack(env=env, url=f"http://127.0.0.1:{port}", key=key, models=models)
    s.compose("down", "-v", "--remove-orphans", check=False)
    try:
        s.compose("up", "-d", "--no-build", "--scale", "worker=2")
        wait_until("every container healthy", 300, s.all_healthy, every=2)
        yield s
    finally:
        if sys.exc_info()[0] is not None:
            print(s.compose("logs", "--tail", "50", check=False).stdout, file=sys.stderr)
        s.compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        shutil.rmtree(models)


def test_compose_commands_work_without_api_keys(stack: Stack) -> None:
    env = {k: v for k, v in stack.env.items() if k != "MODELPREP_API_KEYS"}
    result = run("docker-compose", "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"),
                 "ps", env=env)
    assert "api" in result.stdout and "worker" in result.stdout


def test_jobs_need_a_key_and_run_to_a_full_finished_progress(stack: Stack) -> None:
    anonymous = httpx.post(f"{stack.url}/v1/jobs", json={}, timeout=30)
    assert anonymous.status_code == 401
    with stack.client() as client:
        job = client.post("/v1/jobs", json={
            "source": "file:///models/llama",
            "exports": [{"format": "safetensors", "dtype": "float16"}],
        }).json()
        done = wait_until("the job to end", 300, lambda: _ended(client, job["id"]))
    assert done["status"] == "succeeded", done["error"]
    files = {a["path"] for a in done["artifacts"]}
    assert done["progress"] == {"done": len(files), "total": len(files), "unit": "files"}


def test_a_q4_k_m_job_runs_llama_cpp_inside_the_image(stack: Stack) -> None:
    """The image's own llama.cpp (built in its llama-cpp stage): llama-quantize writes the
    K-quant mixture, llama-tokenize matches the tokenizer, llama-perplexity bounds the loss."""
    with stack.client() as client:
        job = client.post("/v1/jobs", json={
            "source": "file:///models/smollm2",
            "exports": [{"format": "gguf", "type": "q4_k_m"}],
        }).json()
        done = wait_until("the job to end", 900, lambda: _ended(client, job["id"]), every=2)
    assert done["status"] == "succeeded", done["error"]
    manifest = json.loads(stack.compose(
        "exec", "-T", "api", "cat", f"/data/jobs/{job['id']}/artifacts/manifest.json"
    ).stdout)
    (export,) = manifest["exports"]
    assert export["type"] == "Q4_K_M" and export["quantizer"] == "llama-quantize", export
    checks = export["llama_cpp"]
    assert checks["tokenizer"] and checks["perplexity"]["quantized"] > 0, checks
    assert checks["perplexity"]["ratio"] <= checks["perplexity"]["bound"], checks


def _ended(client: httpx.Client, job_id: str) -> dict[str, Any] | None:
    job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def test_a_killed_worker_s_job_is_finished_once_by_the_other(stack: Stack) -> None:
    with stack.client() as client:
        job = client.post("/v1/jobs", json={
            "source": "file:///models/llama",
            "exports": [{"format": "safetensors", "dtype": "bfloat16"}],
            "max_memory": "64MiB",  # offloaded and paged in: a job that lasts
        }).json()

        def running() -> dict[str, Any] | None:
            state: dict[str, Any] = client.get(f"/v1/jobs/{job['id']}").json()
            assert state["status"] in ("queued", "running"), state
            return state if state["status"] == "running" else None

        first = wait_until("the job to start", 120, running, every=0.2)
        assert first["phase"] != "queued"
        worker_host = stack.job_worker(job["id"]).split(":")[0]  # hostname: the short id
        victim = next(c for c in stack.containers() if c.startswith(worker_host))
        run("docker", "kill", victim)
        done = wait_until("the job to end", 300 + HEARTBEAT_TIMEOUT,
                          lambda: _ended(client, job["id"]))
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 2  # the killed attempt, then the one that finished it
        listed = sorted(a["path"] for a in done["artifacts"])
    # exactly one set of artifacts on the shared volume: what the job lists, nothing else
    on_disk = stack.compose(
        "exec", "-T", "api", "sh", "-c",
        f"cd /data/jobs/{job['id']}/artifacts && find . -type f | sed 's#^./##' | sort",
    ).stdout.split()
    assert on_disk == listed
    run("docker", "start", victim)  # a no-op if its restart policy brought it back already
    wait_until("every container healthy again", 300, stack.all_healthy, every=2)
