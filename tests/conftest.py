"""Session-wide fixtures: tiny real checkpoints built once per test session by tests/fixtures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.models import Arch, CheckpointKind, build_checkpoint

TinyCheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    """``tiny_checkpoint(arch="llama", kind="safetensors", tied=False)`` -> a checkpoint directory.

    Built once per combination and shared by the session: treat it as READ-ONLY (copy it with
    ``tests.fixtures.models.copy_tree`` before breaking it).
    """
    cache: dict[tuple[str, str, bool], Path] = {}

    def get(arch: Arch = "llama", kind: CheckpointKind = "safetensors", tied: bool = False) -> Path:
        key = (arch, kind, tied)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{kind}{'-tied' if tied else ''}")
            cache[key] = build_checkpoint(out, arch, kind, tie_word_embeddings=tied)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llama_safetensors_dir(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("llama", "safetensors")


@pytest.fixture(scope="session")
def llama_sharded_safetensors_dir(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("llama", "safetensors-sharded")


@pytest.fixture(scope="session")
def llama_bin_dir(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("llama", "bin")


@pytest.fixture(scope="session")
def llama_sharded_bin_dir(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("llama", "bin-sharded")


@pytest.fixture(scope="session")
def bert_safetensors_dir(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("bert", "safetensors")
