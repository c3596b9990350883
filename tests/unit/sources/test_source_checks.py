"""Submission-time source checks: cheap, offline, and typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.config import Settings
from service.errors import InvalidRequest, NoWeightFiles, SourceNotAllowed
from service.sources import SourceRequest, check_source
from service.sources.hub import parse_hf_uri, plan_files, shards_of


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # An endpoint nothing listens on: a check that touched the network would fail.
    return Settings(data_dir=tmp_path, hf_endpoint="http://127.0.0.1:9", local_roots=[tmp_path])


@pytest.mark.parametrize("uri", ["hf://org/repo", "hf://Org-1/repo_name.v2", "hf://org/repo/"])
def test_well_formed_hub_ids_pass_the_check(settings: Settings, uri: str) -> None:
    check_source(SourceRequest(uri, revision="v1.0"), settings)


@pytest.mark.parametrize("uri", [
    "hf://repo-without-org", "hf://org/repo/extra", "hf://org/re--po", "hf://org/..",
    "hf://org/repo?x=1", "hf://org/repo@main", "hf:///org/repo", "hf://org/re po",
])
def test_malformed_hub_ids_are_invalid_requests(settings: Settings, uri: str) -> None:
    with pytest.raises(InvalidRequest):
        check_source(SourceRequest(uri), settings)


@pytest.mark.parametrize("revision", ["../main", "a b", "-rf", "main/", "x.lock", ""])
def test_malformed_revisions_are_invalid_requests(settings: Settings, revision: str) -> None:
    with pytest.raises(InvalidRequest):
        check_source(SourceRequest("hf://org/repo", revision=revision), settings)


def test_revision_defaults_to_main() -> None:
    assert parse_hf_uri("hf://org/repo", None).revision == "main"


@pytest.mark.parametrize("uri", ["ftp://host/model.bin", "gs://bucket/model.bin", "gopher://x/y"])
def test_unknown_schemes_are_invalid_requests(settings: Settings, uri: str) -> None:
    with pytest.raises(InvalidRequest, match="unsupported source scheme"):
        check_source(SourceRequest(uri), settings)


@pytest.mark.parametrize("uri", [
    "https://user:pw@host/model.safetensors",  # credentials would be stored with the job
    "https://host/",                            # no file name to tell the format
    "http:///model.bin",                        # no host
])
def test_unusable_http_urls_are_invalid_requests(settings: Settings, uri: str) -> None:
    with pytest.raises(InvalidRequest):
        check_source(SourceRequest(uri), settings)


def test_malformed_sha256_is_an_invalid_request(settings: Settings) -> None:
    with pytest.raises(InvalidRequest, match="sha256"):
        check_source(SourceRequest("https://h/m.safetensors", sha256="abc"), settings)
    check_source(SourceRequest("https://h/m.safetensors", sha256="A" * 64), settings)


def test_file_source_outside_the_roots_is_refused(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(SourceNotAllowed):
        check_source(SourceRequest("file:///etc/passwd"), settings)
    (tmp_path / "m.safetensors").write_bytes(b"x")
    check_source(SourceRequest(f"file://{tmp_path / 'm.safetensors'}"), settings)


def test_plan_prefers_safetensors_over_bin() -> None:
    plan = plan_files(["config.json", "model.safetensors", "pytorch_model.bin",
                       "tokenizer.json", "README.md", "onnx/model.onnx", "sub/config.json"])
    assert plan.format == "safetensors"
    assert plan.weights == ["model.safetensors"]
    assert plan.aux == ["config.json", "tokenizer.json"]
    assert plan.index is None


def test_plan_sharded_safetensors_takes_the_index() -> None:
    files = ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "consolidated.safetensors"]
    plan = plan_files(files)
    assert plan.index == "model.safetensors.index.json"


def test_plan_falls_back_to_pickles_without_trainer_state() -> None:
    plan = plan_files(["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                       "pytorch_model.bin.index.json", "training_args.bin", "optimizer.pt",
                       "rng_state.pth", "generation_config.json"])
    assert plan.format == "pickle"
    assert plan.index == "pytorch_model.bin.index.json"
    assert plan.weights == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    assert plan.aux == ["generation_config.json"]


def test_plan_accepts_pt_files() -> None:
    assert plan_files(["weights.pt", "config.json"]).weights == ["weights.pt"]


def test_repo_without_weights_raises_no_weight_files() -> None:
    with pytest.raises(NoWeightFiles):
        plan_files(["config.json", "README.md", "training_args.bin", "sub/model.safetensors"])


def test_index_shards_must_be_files_of_the_commit(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    assert shards_of(index, ["s1.safetensors", "s2.safetensors"]) == ["s1.safetensors",
                                                                    "s2.safetensors"]
    with pytest.raises(NoWeightFiles):
        shards_of(index, ["s1.safetensors"])
    index.write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(NoWeightFiles):
        shards_of(index, ["../../etc/passwd"])
