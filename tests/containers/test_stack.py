"""The image and the compose stack, built and run for real: a Docker engine, the Dockerfile, the
docker-compose.yml a user runs (API, two workers, PostgreSQL, the SeaweedFS object store), jobs
submitted with an API key, a worker killed mid-job, the job's one set of artifacts in the bucket,
a job read from s3:// and downloaded both through the API and directly from the bucket, a job
over a checkpoint larger than the worker container's memory limit, every container's health,
teardown. API and workers share no volume: only PostgreSQL and the bucket.

Base images come from the local image store; where no registry answers they are built from
Debian packages first (scripts/container_base_images.sh). Torch comes from this machine's local
wheel directory when it has one (served to the build on loopback), else from the CPU index.
Run with ``make container-test``; ``.ci/run`` runs it when a Docker engine starts."""

from __future__ import annotations

import json
import os
import shutil
import socket
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
import obstore
import pytest
from obstore.store import S3Store
from transformers import LlamaConfig, LlamaForCausalLM

from service.api.auth import keygen_line
from service.client import ModelprepClient
from service.fsutil import sha256_file
from tests.fixtures.models import save_checkpoint, tiny_llama_config
from tests.fixtures.real_models import real_model
from tests.fixtures.service import free_port

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "modelprep-ct"
IMAGE = "modelprep:latest"
OBJECTSTORE_IMAGE = "modelprep-objectstore:latest"
BUCKET = "modelprep"
S3_KEY, S3_SECRET = "ct-access", "ct-secret-0123456789"
WORKER_MEM_LIMIT = 2 * 1024**3
"""The worker container's mem_limit: one job slot, so a job's budget is this less the worker's
own share; the big job's checkpoint is larger than the whole container."""
LOCAL_WHEELS = Path("/opt/wheels")
EXTRA_CA = Path("/usr/local/share/ca-certificates")
HEARTBEAT_TIMEOUT = 20
WHEEL_PORT = 47613
"""The wheel server's port whenever it is free: its URL is in the TORCH_PIP_ARGS build argument,
and a build argument whose value changes misses Docker's build cache from its first use on, so a
random port would reinstall torch and every dependency on each run."""


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


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def wheel_server() -> Iterator[str | None]:
    """This machine's local wheels over HTTP on loopback, for pip inside the build."""
    if not LOCAL_WHEELS.is_dir():
        yield None
        return
    port = WHEEL_PORT if _port_is_free(WHEEL_PORT) else free_port()
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
    """modelprep's image, and the object store's (SeaweedFS from PyPI on the same base)."""
    run(str(ROOT / "scripts" / "container_base_images.sh"), timeout=1200)
    args = ["docker", "build", "--network", "host"]
    pems = sorted(EXTRA_CA.glob("*.crt")) if EXTRA_CA.is_dir() else []
    if pems:  # a TLS-inspecting proxy between this machine and the package index
        pem = "\n".join(p.read_text().strip() for p in pems)
        args += ["--build-arg", f"PIP_CA_PEM={pem}"]
    started = time.monotonic()
    run("nice", "-n", "10", *args, "-t", OBJECTSTORE_IMAGE, str(ROOT / "deploy" / "objectstore"),
        timeout=900)
    if wheel_server:
        args += ["--build-arg", f"TORCH_PIP_ARGS=--find-links {wheel_server}"]
    run("nice", "-n", "10", *args, "-t", IMAGE, str(ROOT), timeout=1800)
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
    s3_endpoint: str
    """The object store as this host reaches it (the published port): presigned URLs name it."""

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
        return len(health) == 5 and set(health.values()) == {"healthy"}

    def job_worker(self, job_id: str) -> str:
        """Who runs the job (``host:pid``), read from PostgreSQL in its container."""
        return self.compose(
            "exec", "-T", "postgres", "psql", "-U", "modelprep", "-d", "modelprep", "-tAc",
            f"select worker from jobs where id = '{job_id}'",
        ).stdout.strip()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.key}"},
                            timeout=30)

    def bucket(self) -> S3Store:
        """A client of the stack's bucket from this host, with the stack's key pair."""
        return S3Store(BUCKET, endpoint=self.s3_endpoint, region="us-east-1",
                       access_key_id=S3_KEY, secret_access_key=S3_SECRET,
                       client_options={"allow_http": True})

    def keys(self, prefix: str) -> list[str]:
        return sorted(str(m["path"]) for batch in obstore.list(self.bucket(), prefix + "/")
                      for m in batch)

    def manifest(self, job: dict[str, Any]) -> dict[str, Any]:
        """The job's manifest, read from the bucket (no container keeps it)."""
        key = f"{job_prefix(job)}/manifest.json"
        loaded: dict[str, Any] = json.loads(bytes(obstore.get(self.bucket(), key).bytes()))
        return loaded


def job_prefix(job: dict[str, Any]) -> str:
    """The key prefix the job's artifacts were published under, from its JSON."""
    uri: str = job["artifact_store"]["uri"]
    assert uri.startswith(f"s3://{BUCKET}/jobs/ct/"), uri  # the tenant's prefix
    return uri.removeprefix(f"s3://{BUCKET}/")


BIG_SHAPE = {"layers": 14, "hidden": 1536, "intermediate": 4096, "vocab": 49152}
"""float32 with SmolLM2's vocabulary: 2 x 302 MB of embedding and head, 14 layers of 113 MB:
2.19 GB, more than the worker container's WORKER_MEM_LIMIT (2 GiB)."""


def write_model(models: Path) -> Path:
    """A Llama checkpoint big enough (~70M parameters) that its job runs for a while, and the
    real SmolLM2-135M (with its tokenizer) for the job that runs llama.cpp in the image."""
    config = LlamaConfig(**{**tiny_llama_config().to_dict(), "hidden_size": 768,
                            "intermediate_size": 2048, "num_hidden_layers": 8,
                            "num_attention_heads": 12, "num_key_value_heads": 4})
    model = LlamaForCausalLM(config)
    out = save_checkpoint(model, models / "llama", "safetensors")
    shutil.copytree(real_model("smollm2"), models / "smollm2")
    from bench.export_gguf import smollm2_tokenizer
    from bench.synth_checkpoint import write_checkpoint

    big = models / "big"
    write_checkpoint(big, BIG_SHAPE["layers"], BIG_SHAPE["hidden"], BIG_SHAPE["intermediate"],
                     vocab=BIG_SHAPE["vocab"])
    smollm2_tokenizer(models / "tokenizer")
    for f in (models / "tokenizer").iterdir():
        shutil.copy(f, big / f.name)
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the containers read as uid 1000
    return out


@pytest.fixture(scope="module")
def stack(image: str) -> Iterator[Stack]:
    models = Path(tempfile.mkdtemp(prefix="modelprep-ct-models-"))
    write_model(models)
    key, entry = keygen_line("ct", admin=False)
    port, s3_port = free_port(), free_port()
    s3_endpoint = f"http://127.0.0.1:{s3_port}"
    env = {**os.environ, "MODELPREP_API_KEYS": f"[{entry}]", "MODELPREP_PORT": str(port),
           "MODELPREP_MODELS_DIR": str(models),
           "MODELPREP_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
           "MODELPREP_S3_PORT": str(s3_port), "MODELPREP_S3_PUBLIC_ENDPOINT": s3_endpoint,
           "MODELPREP_S3_ACCESS_KEY": S3_KEY, "MODELPREP_S3_SECRET_KEY": S3_SECRET,
           "MODELPREP_WORKER_MEM_LIMIT": str(WORKER_MEM_LIMIT), "MODELPREP_WORKER_SLOTS": "1"}
    s = Stack(env=env, url=f"http://127.0.0.1:{port}", key=key, models=models,
              s3_endpoint=s3_endpoint)
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
    # the last phase is the publication to the bucket: its progress counts bytes uploaded
    progress = done["progress"]
    assert progress["unit"] == "bytes" and progress["done"] == progress["total"] > 0, progress


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
    manifest = stack.manifest(done)
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
        listed = sorted(f"{job_prefix(done)}/{a['path']}" for a in done["artifacts"])
    # exactly one set of artifacts in the bucket: what the job lists, nothing else
    assert stack.keys(job_prefix(done)) == listed
    run("docker", "start", victim)  # a no-op if its restart policy brought it back already
    wait_until("every container healthy again", 300, stack.all_healthy, every=2)


def test_a_job_from_s3_is_published_to_the_bucket_and_downloaded_both_ways(
    stack: Stack, tmp_path: Path
) -> None:
    """Source from s3://, artifacts in the bucket only, downloaded through the API (a 307 to a
    presigned URL naming MODELPREP_S3_PUBLIC_ENDPOINT, which this host reaches) and directly
    from the bucket; every sha256 matches the manifest."""
    bucket = stack.bucket()
    source = stack.models / "smollm2"
    for path in sorted(source.iterdir()):
        if path.is_file():
            obstore.put(bucket, f"sources/smollm2/{path.name}", path)
    with stack.client() as client:
        response = client.post("/v1/jobs", json={
            "source": f"s3://{BUCKET}/sources/smollm2",
            "exports": [{"format": "gguf", "type": "q8_0"}, {"format": "safetensors"}],
        })
        assert response.status_code == 202, response.text
        done = wait_until("the job to end", 900, lambda: _ended(client, response.json()["id"]),
                          every=2)
        assert done["status"] == "succeeded", done["error"]
        redirect = client.get(done["artifacts"][0]["url"])
        assert redirect.status_code == 307, redirect.text
        assert redirect.headers["location"].startswith(stack.s3_endpoint + f"/{BUCKET}/")
    assert done["source"]["digest"], done["source"]
    prefix = job_prefix(done)
    names = sorted(a["path"] for a in done["artifacts"])
    assert stack.keys(prefix) == [f"{prefix}/{n}" for n in names]
    manifest = stack.manifest(done)
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    assert any(n.endswith(".gguf") for n in listed) and "README.md" in names

    with ModelprepClient(stack.url, stack.key) as api:
        files = api.download(done, tmp_path / "via-api")
    assert sorted(p.relative_to(tmp_path / "via-api").as_posix() for p in files) == names
    for name in names:
        via_api = sha256_file(tmp_path / "via-api" / name)
        direct = tmp_path / "direct" / name
        direct.parent.mkdir(parents=True, exist_ok=True)
        with direct.open("wb") as f:
            for chunk in obstore.get(bucket, f"{prefix}/{name}"):
                f.write(chunk)
        assert sha256_file(direct) == via_api
        if name != "manifest.json":
            assert listed[name] == via_api, name
    for data in ("api", "worker"):  # no container keeps a job's artifacts
        out = stack.compose("exec", "-T", data, "sh", "-c",
                            "ls -d /data/jobs/*/artifacts 2>/dev/null | wc -l").stdout
        assert out.strip() == "0", (data, out)


def test_a_checkpoint_larger_than_the_worker_container_is_exported_and_verified(
    stack: Stack,
) -> None:
    """GGUF q8_0 and safetensors, verify on, of a checkpoint larger than the worker's
    mem_limit: the worker reads its container's limit, the job stays within its budget, and
    the manifest carries the memory figures."""
    big = stack.models / "big"
    size = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    assert size > WORKER_MEM_LIMIT, size
    with stack.client() as client:
        response = client.post("/v1/jobs", json={
            "source": "file:///models/big",
            "exports": [{"format": "gguf", "type": "q8_0"}, {"format": "safetensors"}],
        })
        assert response.status_code == 202, response.text
        done = wait_until("the job to end", 1500, lambda: _ended(client, response.json()["id"]),
                          every=5)
    assert done["status"] == "succeeded", done["error"]
    manifest = stack.manifest(done)
    figures = manifest["memory"]
    assert figures["limit_bytes"] == WORKER_MEM_LIMIT, figures
    assert figures["limit_source"].startswith("cgroup"), figures
    assert figures["job_budget_bytes"] < WORKER_MEM_LIMIT, figures
    assert all("peak_rss_bytes" in phase for phase in figures["phases"]), figures
    # where the job had a memory cgroup of its own, its charge (page cache included) stayed
    # within the budget; without one the executor accounted for it (it succeeded)
    cgroup_peaks = [phase.get("cgroup_peak_bytes") or 0 for phase in figures["phases"]]
    assert max(cgroup_peaks) <= figures["job_budget_bytes"], figures
    for export in manifest["exports"]:  # each consumer's check recorded, with its figures
        checks = {k: v for k, v in export.items() if k in ("verify", "verification", "llama_cpp")}
        assert checks, f"no consumer check recorded for {export['format']}: {sorted(export)}"
    print(json.dumps({"checkpoint_bytes": size, "memory": figures}), file=sys.stderr)
