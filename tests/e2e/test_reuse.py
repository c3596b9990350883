"""Result reuse end to end: a real service (SQLite, local pool of two), real sources (local
directories, a loopback HTTP server, olah as the hub), real job processes. A job that computed
its artifacts ran the ``export`` phase; one that reused them did not and names the job it
shares them with; shared files are the same inodes."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.hub import LocalHub, files_of
from tests.fixtures.models import build_checkpoint
from tests.fixtures.service import ServiceProcess, running_service

EXPORTS = [{"format": "safetensors"}]
TRICKLE = 60_000
"""bytes/s: the tiny llama's weights take seconds, so a second job settles while one runs."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors", seed=0)
    shutil.copytree(root / "llama", root / "llama-copy")
    build_checkpoint(root / "llama-other", "llama", "safetensors", seed=1)
    return root


@pytest.fixture(scope="module")
def service(
    root: Path, local_hub: LocalHub, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    env = {
        "MODELPREP_WORKERS": "2",
        "MODELPREP_HF_ENDPOINT": local_hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with running_service(tmp_path_factory.mktemp("data"), [root], env=env) as svc:
        yield svc


def submit(svc: ServiceProcess, body: dict[str, Any]) -> str:
    with svc.client() as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def run(svc: ServiceProcess, body: dict[str, Any]) -> dict[str, Any]:
    job = svc.wait_for(submit(svc, body), timeout=180)
    assert job["status"] == "succeeded", job["error"]
    return job


def computed(job: dict[str, Any]) -> bool:
    """Whether the job ran the pipeline's export phase itself."""
    return any(p["phase"] == "export" for p in job.get("phases", []))


def assert_shares(svc: ServiceProcess, reuser: dict[str, Any], original: dict[str, Any]) -> None:
    assert reuser["reused_from"] == original["id"]
    assert not computed(reuser)
    strip = [{k: a[k] for k in ("path", "size", "sha256")} for a in original["artifacts"]]
    assert [{k: a[k] for k in ("path", "size", "sha256")} for a in reuser["artifacts"]] == strip
    jobs = svc.data_dir / "jobs"
    for artifact in original["artifacts"]:
        mine = jobs / reuser["id"] / "artifacts" / artifact["path"]
        theirs = jobs / original["id"] / "artifacts" / artifact["path"]
        if theirs.exists():
            assert os.path.samefile(mine, theirs), f"{artifact['path']} was copied, not shared"


def download(svc: ServiceProcess, job: dict[str, Any], path: str) -> tuple[int, bytes]:
    with svc.client() as client:
        response = client.get(f"/v1/jobs/{job['id']}/artifacts/{path}")
    return response.status_code, response.content


def test_an_identical_local_job_shares_the_first_ones_artifacts_which_outlive_either_delete(
    service: ServiceProcess, root: Path
) -> None:
    first = run(service, {"source": f"file://{root / 'llama'}", "exports": EXPORTS})
    assert computed(first) and first["reused_from"] is None
    # the same bytes in another directory, the export's default spelled out, another budget
    same = {"source": f"file://{root / 'llama-copy'}", "max_memory": "64MiB",
            "exports": [{"format": "safetensors", "max_shard_size": "5GB"}]}
    second = run(service, same)
    assert_shares(service, second, first)
    assert second["reuse"]["key"] == first["reuse"]["key"]
    assert second["source"]["identity"].startswith("files:")
    assert second["metrics"]["reused_bytes"] == sum(a["size"] for a in first["artifacts"])
    assert second["metrics"]["reused_bytes_copied"] == 0
    print(f"\nFIGURE local: first job {first['metrics']['wall_seconds']} s, "
          f"reused {second['metrics']['wall_seconds']} s")

    weights = "safetensors/model.safetensors"
    status, expected = download(service, first, weights)
    assert status == 200
    with service.client() as client:
        deleted = client.delete(f"/v1/jobs/{first['id']}")
    assert deleted.status_code == 200, deleted.text
    # the shared artifacts are still held by the second job: deleting the first frees none
    assert deleted.json()["metrics"]["artifact_bytes_freed"] < len(expected)
    assert download(service, first, weights)[0] == 410
    assert download(service, second, weights) == (200, expected)

    # the deleted job is no longer offered; the job that shares its files is
    third = run(service, same)
    assert_shares(service, third, second)
    with service.client() as client:
        assert client.delete(f"/v1/jobs/{third['id']}").status_code == 200
    assert download(service, second, weights) == (200, expected)


def test_reuse_false_a_changed_recipe_and_changed_weights_compute_anew(
    service: ServiceProcess, root: Path
) -> None:
    source = f"file://{root / 'llama'}"
    body = {"source": source, "exports": [{"format": "safetensors", "dtype": "float16"}]}
    first = run(service, body)
    again = run(service, {**body, "reuse": False})
    assert computed(again) and again["reused_from"] is None
    later = run(service, body)  # offered: the newest succeeded job
    assert_shares(service, later, again)
    unverified = run(service, {**body, "verify": False})
    assert computed(unverified) and unverified["reused_from"] is None
    other = run(service, {**body, "source": f"file://{root / 'llama-other'}"})
    assert computed(other) and other["reused_from"] is None
    assert first["reuse"]["key"] != other["reuse"]["key"]


def test_two_identical_jobs_submitted_together_compute_once(
    service: ServiceProcess, root: Path, http_server: FileServer
) -> None:
    weights = root / "llama" / "model.safetensors"
    sha256 = hashlib.sha256(weights.read_bytes()).hexdigest()
    url = http_server.add("/together/model.safetensors",
                          Route(body=weights, bytes_per_second=TRICKLE))
    body = {"source": url, "sha256": sha256, "exports": [{"format": "safetensors",
                                                           "dtype": "bfloat16"}]}
    ids = [submit(service, body), submit(service, body)]
    jobs = [service.wait_for(job_id, timeout=180) for job_id in ids]
    assert all(j["status"] == "succeeded" for j in jobs), [j["error"] for j in jobs]
    ran = [j for j in jobs if computed(j)]
    assert len(ran) == 1, [j.get("phases") for j in jobs]
    [reuser] = [j for j in jobs if not computed(j)]
    assert_shares(service, reuser, ran[0])
    assert reuser["reuse"]["waited_for"] == [ran[0]["id"]]  # it attached to the running one
    assert reuser["source"]["identity"] == f"sha256:{sha256}"


def test_an_http_file_without_sha256_is_reused_once_downloaded_and_hashed(
    service: ServiceProcess, root: Path, http_server: FileServer
) -> None:
    weights = root / "llama" / "model.safetensors"
    one = http_server.add("/a/model.safetensors", Route(body=weights))
    two = http_server.add("/b/model.safetensors", Route(body=weights))
    exports = [{"format": "safetensors", "dtype": "float32"}]
    first = run(service, {"source": one, "exports": exports})
    second = run(service, {"source": two, "exports": exports})
    assert_shares(service, second, first)
    # downloaded once to be hashed; submission's header read (a bounded range) is no download
    assert len(http_server.downloads("/b/model.safetensors")) == 1
    assert second["source"]["identity"] == \
        f"sha256:{hashlib.sha256(weights.read_bytes()).hexdigest()}"
    # the declared sha256 of the same bytes is the same identity: reused before any download
    declared = run(service, {"source": http_server.add("/c/model.safetensors", Route(body=weights)),
                             "sha256": second["source"]["identity"][len("sha256:"):],
                             "exports": exports})
    assert declared["reused_from"] in (first["id"], second["id"])
    assert http_server.downloads("/c/model.safetensors") == []


def test_a_hub_branch_is_resolved_to_its_commit_first_then_reused_without_a_download(
    service: ServiceProcess, root: Path, local_hub: LocalHub
) -> None:
    repo = f"org/reuse-{os.urandom(4).hex()}"
    main_sha = local_hub.create_repo(repo, files_of(root / "llama"))
    first = run(service, {"source": f"hf://{repo}", "exports": EXPORTS})
    assert computed(first) and first["source"]["revision"] == main_sha
    by_sha = run(service, {"source": f"hf://{repo}", "revision": main_sha, "exports": EXPORTS})
    assert_shares(service, by_sha, first)
    assert by_sha["source"]["identity"].endswith(f"/{repo}@{main_sha}")
    # one download; each submission's header read is a bounded range, cut after the header
    assert len(local_hub.downloads(repo, "resolve", "model.safetensors")) == 1
    # main moves: the same request now names another commit, which is computed
    new_sha = local_hub.create_repo(repo, files_of(root / "llama-other"), message="v2")
    moved = run(service, {"source": f"hf://{repo}", "exports": EXPORTS})
    assert computed(moved) and moved["reused_from"] is None
    assert moved["source"]["revision"] == new_sha


def test_a_job_waiting_for_an_identical_one_that_fails_computes_itself(
    service: ServiceProcess, root: Path, http_server: FileServer
) -> None:
    weights = root / "llama-other" / "model.safetensors"  # bytes no other test downloads
    sha256 = hashlib.sha256(weights.read_bytes()).hexdigest()
    url = http_server.add("/cancelled/model.safetensors",
                          Route(body=weights, bytes_per_second=TRICKLE // 4))
    body = {"source": url, "sha256": sha256, "exports": [{"format": "safetensors",
                                                           "dtype": "float16"}],
            "verify": False}
    first = submit(service, body)
    deadline = time.monotonic() + 60
    while not any(s.path == "/cancelled/model.safetensors" for s in http_server.seen):
        assert time.monotonic() < deadline, service.logs()[-3000:]
        time.sleep(0.1)
    second = submit(service, body)
    with service.client() as client:
        while client.get(f"/v1/jobs/{second}").json().get("reuse", {}).get("waiting_for") is None:
            assert time.monotonic() < deadline, service.logs()[-3000:]
            time.sleep(0.1)
        http_server.add("/cancelled/model.safetensors", Route(body=weights))  # fast from now
        assert client.delete(f"/v1/jobs/{first}").status_code == 202
    assert service.wait_for(first)["status"] == "cancelled"
    done = service.wait_for(second, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert computed(done) and done["reused_from"] is None
    assert done["reuse"]["waited_for"] == [first]
