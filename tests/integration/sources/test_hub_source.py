"""hf:// sources against olah serving local git repositories, and the Hub's error answers
(which olah cannot give) against a small real HTTP server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import pytest
from pydantic import SecretStr

from service.config import Settings
from service.errors import (
    DownloadFailed,
    DownloadTooLarge,
    JobCancelled,
    NoWeightFiles,
    RepositoryNotFound,
    RevisionNotFound,
    SourceUnauthorized,
)
from service.sources import SourceRequest, fetch_source
from service.sources.cache import release_all
from service.stage import InMemoryContext
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.hub import LocalHub, files_of, hub_client_env
from tests.fixtures.models import build_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[3]
TOKEN = "hf_sEcReTtOkEn0123456789abcdefXYZ"


@pytest.fixture(autouse=True)
def _hub_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # olah serves plain HTTP downloads only; huggingface_hub reads this at import.
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    yield
    release_all()


@pytest.fixture(scope="module")
def llama_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("v1"), "llama", "safetensors", seed=1)


@pytest.fixture(scope="module")
def llama_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("v2"), "llama", "safetensors", seed=2)


def _settings(tmp_path: Path, endpoint: str, **extra: object) -> Settings:
    return Settings(data_dir=tmp_path / "data", hf_endpoint=endpoint, download_retries=1,
                    download_backoff_seconds=0.01, **extra)  # type: ignore[arg-type]


def _ctx(settings: Settings, name: str = "job") -> InMemoryContext:
    return InMemoryContext(settings=settings, work_dir=settings.data_dir / "jobs" / name)


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_branch_and_tag_resolve_to_their_commits(
    local_hub: LocalHub, llama_v1: Path, llama_v2: Path, tmp_path: Path
) -> None:
    sha_tag = local_hub.create_repo("org/revs", files_of(llama_v1), tag="v1.0")
    sha_branch = local_hub.create_repo("org/revs", files_of(llama_v2), branch="dev")
    settings = _settings(tmp_path, local_hub.endpoint)

    for revision, sha, source in (("v1.0", sha_tag, llama_v1), ("dev", sha_branch, llama_v2),
                                  (None, sha_tag, llama_v1), (sha_branch, sha_branch, llama_v2)):
        ctx = _ctx(settings)
        resolved = fetch_source(SourceRequest("hf://org/revs", revision=revision), settings, ctx)
        assert resolved.revision == sha
        assert ctx.details["source"]["revision"] == sha
        assert ctx.details["source"]["files"] == _names(resolved.path)
        assert (resolved.path / "model.safetensors").read_bytes() == \
            (source / "model.safetensors").read_bytes()
    assert sha_tag != sha_branch


def test_later_job_of_same_commit_is_a_cache_hit(
    local_hub: LocalHub, llama_v1: Path, tmp_path: Path
) -> None:
    local_hub.create_repo("org/hit", files_of(llama_v1))
    settings = _settings(tmp_path, local_hub.endpoint)
    first_ctx, second_ctx = _ctx(settings, "a"), _ctx(settings, "b")
    first = fetch_source(SourceRequest("hf://org/hit"), settings, first_ctx)
    second = fetch_source(SourceRequest("hf://org/hit"), settings, second_ctx)
    weights = (llama_v1 / "model.safetensors").stat().st_size
    assert first_ctx.metrics["cache_hit"] is False
    assert first_ctx.metrics["bytes_downloaded"] >= weights
    assert second_ctx.metrics == {"cache_hit": True, "bytes_downloaded": 0}
    assert second.path == first.path
    assert local_hub.served("GET", "/org/hit/resolve/") == len(_names(first.path))
    assert (first_ctx.done, first_ctx.total) == (weights, weights)


def test_size_limit_evicts_finished_jobs_entries_but_not_a_running_jobs(
    local_hub: LocalHub, llama_v1: Path, llama_v2: Path, tmp_path: Path
) -> None:
    local_hub.create_repo("org/lru-a", files_of(llama_v1))
    local_hub.create_repo("org/lru-b", files_of(llama_v2))
    local_hub.create_repo("org/lru-c", files_of(llama_v1))
    one_model = sum(p.stat().st_size for p in llama_v1.iterdir())
    settings = _settings(tmp_path, local_hub.endpoint, cache_max_bytes=one_model + one_model // 2)

    a = fetch_source(SourceRequest("hf://org/lru-a"), settings, _ctx(settings, "a"))
    release_all()  # job a ended
    b = fetch_source(SourceRequest("hf://org/lru-b"), settings, _ctx(settings, "b"))
    assert not a.path.exists()  # least recently used and no longer in use
    c = fetch_source(SourceRequest("hf://org/lru-c"), settings, _ctx(settings, "c"))
    assert b.path.exists() and c.path.exists()  # b's job still runs: over the limit, not evicted
    release_all()


def test_only_safetensors_are_fetched_when_bin_is_present_too(
    local_hub: LocalHub, llama_v1: Path, tmp_path: Path
) -> None:
    bins = build_checkpoint(tmp_path / "bin", "llama", "bin", seed=1)
    files: dict[str, bytes | Path] = {**files_of(llama_v1), "pytorch_model.bin": bins / "pytorch_model.bin",
             "README.md": b"# tiny\n", "onnx/model.onnx": b"onnx"}
    local_hub.create_repo("org/both", files)
    settings = _settings(tmp_path, local_hub.endpoint)
    ctx = _ctx(settings)
    resolved = fetch_source(SourceRequest("hf://org/both"), settings, ctx)
    names = _names(resolved.path)
    assert "model.safetensors" in names and "config.json" in names
    assert "tokenizer.json" in names and "generation_config.json" in names
    assert "pytorch_model.bin" not in names and "README.md" not in names and "onnx" not in names
    assert local_hub.served("GET", "/org/both/resolve/") == len(names)
    assert local_hub.served("GET", "/org/both/", "pytorch_model.bin") == 0
    assert ctx.details["source"]["format"] == "safetensors"


def test_sharded_checkpoint_fetches_the_shards_its_index_names(
    local_hub: LocalHub, tmp_path: Path
) -> None:
    sharded = build_checkpoint(tmp_path / "sh", "llama", "safetensors-sharded")
    files: dict[str, bytes | Path] = {**files_of(sharded), "consolidated.safetensors": b"not in the index"}
    local_hub.create_repo("org/sharded", files)
    settings = _settings(tmp_path, local_hub.endpoint)
    resolved = fetch_source(SourceRequest("hf://org/sharded"), settings, _ctx(settings))
    assert _names(resolved.path) == _names(sharded)
    assert local_hub.served("GET", "/org/sharded/", "consolidated.safetensors") == 0


@dataclass
class _CancelAfterFirstBytes(InMemoryContext):
    """A job whose user cancels it once some weight bytes arrived."""

    def advance(self, n: int) -> None:
        super().advance(n)
        if self.done > 0:
            self.cancel_event.set()


def test_cancelled_job_stops_between_shards_and_publishes_nothing(
    local_hub: LocalHub, tmp_path: Path
) -> None:
    sharded = build_checkpoint(tmp_path / "sh", "llama", "safetensors-sharded", seed=4)
    local_hub.create_repo("org/cancelled", files_of(sharded))
    settings = _settings(tmp_path, local_hub.endpoint)
    ctx = _CancelAfterFirstBytes(settings=settings, work_dir=tmp_path / "w")
    with pytest.raises(JobCancelled):
        fetch_source(SourceRequest("hf://org/cancelled"), settings, ctx)
    assert local_hub.served("GET", "/org/cancelled/", "-of-00004.safetensors") == 1
    assert not list(settings.cache_dir.glob("entries/*/entry.json"))
    # a later job resumes the entry: the shard already there is not downloaded again
    resolved = fetch_source(SourceRequest("hf://org/cancelled"), settings, _ctx(settings))
    assert _names(resolved.path) == _names(sharded)
    assert local_hub.served("GET", "/org/cancelled/", "-of-00004.safetensors") == 4


def test_pickle_only_repo_fetches_bin(local_hub: LocalHub, tmp_path: Path) -> None:
    bins = build_checkpoint(tmp_path / "bin", "llama", "bin", seed=3)
    local_hub.create_repo("org/pickled", {**files_of(bins), "training_args.bin": b"state"})
    settings = _settings(tmp_path, local_hub.endpoint)
    ctx = _ctx(settings)
    resolved = fetch_source(SourceRequest("hf://org/pickled"), settings, ctx)
    assert "pytorch_model.bin" in _names(resolved.path)
    assert "training_args.bin" not in _names(resolved.path)
    assert ctx.details["source"]["format"] == "pickle"


def test_repo_without_weights_raises_no_weight_files(local_hub: LocalHub, tmp_path: Path) -> None:
    local_hub.create_repo("org/noweights", {"config.json": b"{}", "README.md": b"hi"})
    settings = _settings(tmp_path, local_hub.endpoint)
    with pytest.raises(NoWeightFiles):
        fetch_source(SourceRequest("hf://org/noweights"), settings, _ctx(settings))


def test_repo_larger_than_the_download_limit_is_refused_before_download(
    local_hub: LocalHub, llama_v1: Path, tmp_path: Path
) -> None:
    local_hub.create_repo("org/toolarge", files_of(llama_v1))
    weights = (llama_v1 / "model.safetensors").stat().st_size
    settings = _settings(tmp_path, local_hub.endpoint, max_download_bytes=weights)
    with pytest.raises(DownloadTooLarge):
        fetch_source(SourceRequest("hf://org/toolarge"), settings, _ctx(settings))
    assert local_hub.served("GET", "/org/toolarge/resolve/") == 0


def test_missing_repository_raises_repository_not_found(
    local_hub: LocalHub, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, local_hub.endpoint)
    with pytest.raises(RepositoryNotFound):
        fetch_source(SourceRequest("hf://org/does-not-exist"), settings, _ctx(settings))


_FETCH_CHILD = """
import json, sys
from pathlib import Path
from service.config import Settings
from service.stage import InMemoryContext
from service.sources import SourceRequest, fetch_source
settings = Settings.model_validate_json(sys.argv[1])
ctx = InMemoryContext(settings=settings, work_dir=Path(sys.argv[2]))
resolved = fetch_source(SourceRequest(sys.argv[3]), settings, ctx)
print(json.dumps({"metrics": ctx.metrics, "revision": resolved.revision}))
"""


def test_two_processes_fetching_one_repo_download_it_once(
    local_hub: LocalHub, llama_v1: Path, tmp_path: Path
) -> None:
    sha = local_hub.create_repo("org/concurrent", files_of(llama_v1))
    settings = _settings(tmp_path, local_hub.endpoint)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _FETCH_CHILD, settings.model_dump_json(),
             str(tmp_path / f"w{i}"), "hf://org/concurrent"],
            cwd=REPO_ROOT, env=hub_client_env(), stdout=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    results = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    assert all(child.returncode == 0 for child in children)
    assert {r["revision"] for r in results} == {sha}
    assert sorted(r["metrics"]["cache_hit"] for r in results) == [False, True]
    assert sorted(r["metrics"]["bytes_downloaded"] > 0 for r in results) == [False, True]
    # every file of the checkpoint once: config, generation config, tokenizer files, weights
    assert local_hub.served("GET", "/org/concurrent/resolve/") == len(files_of(llama_v1))
    assert local_hub.served("GET", "/org/concurrent/resolve/" + sha + "/model.safetensors") == 1


def test_token_never_reaches_logs_details_or_results(
    local_hub: LocalHub, llama_v1: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local_hub.create_repo("org/private", files_of(llama_v1))
    settings = _settings(tmp_path, local_hub.endpoint, hf_token=SecretStr(TOKEN + "-service"))
    ctx = _ctx(settings)
    caplog.set_level(logging.DEBUG)
    request = SourceRequest("hf://org/private", token=SecretStr(TOKEN))
    resolved = fetch_source(request, settings, ctx)
    with pytest.raises(RepositoryNotFound) as failure:
        fetch_source(SourceRequest("hf://org/absent", token=SecretStr(TOKEN)), settings, ctx)

    seen = "\n".join([
        caplog.text, repr(resolved), repr(request), json.dumps(ctx.details, default=str),
        json.dumps(ctx.metrics, default=str), str(failure.value), settings.model_dump_json(),
        local_hub.log.read_text(errors="replace"),
        *(p.read_text(errors="replace") for p in settings.cache_dir.rglob("*.json")),
    ])
    assert "HTTP Request" in caplog.text or "huggingface_hub" in caplog.text  # logs were captured
    assert TOKEN not in seen


# --- the Hub's own error answers, which olah cannot give ----------------------------------------


@pytest.fixture
def hub_errors(http_server: FileServer) -> FileServer:
    """A server answering the Hub's model-info API the way huggingface.co does on errors."""
    api = "/api/models/org/repo/revision"
    http_server.add(f"{api}/nope", Route(status=404, body=b"{}", headers={
        "X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id: nope"}))
    http_server.add(f"{api}/main", Route(status=401, body=b"{}", headers={
        "X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model org/repo is restricted"}))
    http_server.add(f"{api}/badtoken", Route(status=401, body=b"{}", headers={
        "X-Error-Message": "Invalid credentials in Authorization header"}))
    http_server.add(f"{api}/busy", Route(status=503, body=b"{}"))
    return http_server


@pytest.mark.parametrize(("revision", "error"), [
    ("nope", RevisionNotFound), ("main", SourceUnauthorized), ("badtoken", SourceUnauthorized),
    ("busy", DownloadFailed),
])
def test_hub_error_answers_map_to_typed_errors(
    hub_errors: FileServer, tmp_path: Path, revision: str, error: type[Exception]
) -> None:
    settings = _settings(tmp_path, hub_errors.base_url)
    request = SourceRequest("hf://org/repo", revision=revision, token=SecretStr(TOKEN))
    with pytest.raises(error) as failure:
        fetch_source(request, settings, _ctx(settings))
    assert TOKEN not in str(failure.value)


def test_unreachable_hub_fails_after_retries(tmp_path: Path) -> None:
    settings = _settings(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(DownloadFailed, match="after 2 attempts"):
        fetch_source(SourceRequest("hf://org/repo"), settings, _ctx(settings))
