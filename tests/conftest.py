"""Session-wide fixtures (tiny real checkpoints built once per session by tests/fixtures) and
the fast tier's guard: a test under tests/unit that uses a built tool or a model package fails
(tests/fixtures/fast_tier.py says what is forbidden and how it is seen)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest

from tests.fixtures import fast_tier
from tests.fixtures.models import Arch, CheckpointKind, build_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    fast_tier.install()
    # The AWS SDK chain (botocore) asks a cloud's instance metadata service last, at
    # 169.254.169.254: no test may send it a packet, here or from a service it starts.
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A worker of ``make test`` leads a process group of its own, as a serial pytest does:
        # a test reading its own group's memory (service.memory.process_group_private_bytes)
        # sees this worker and what it started, not the other worker's allocations too.
        os.setpgid(0, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier first, in ``make test`` as in ``make test-fast``: it fails soonest, and its
    guard sees imports before a slower test has made them. Then the other modules, heaviest
    first by tests/durations.json (scripts/test_weights.py says why and how it is made).

    ``make test`` runs the suite on two pytest-xdist workers with ``--dist loadfile``: each test
    module runs whole on one worker, so its module fixtures (a job shared by its tests, a
    service) are built once, as in a serial run; ``--no-loadscope-reorder`` hands the modules
    out in this order, so each worker runs its fast-tier modules first and the longest module
    is not the last one started. Within a module the order is the file's."""
    weights = _module_weights()
    default = statistics.median(weights.values()) if weights else 0.0

    def key(item: pytest.Item) -> tuple[bool, float]:
        if fast_tier.in_fast_tier(item):
            return (False, 0.0)
        module = Path(str(item.path)).resolve().relative_to(ROOT).as_posix()
        return (True, -weights.get(module, default))

    items.sort(key=key)  # stable: a module's tests stay together, in their order


def _module_weights() -> dict[str, float]:
    """Each test module's seconds in the last measured full run (module path -> seconds)."""
    path = ROOT / "tests" / "durations.json"
    weights: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}
    return weights


def _guard(item: pytest.Item) -> AbstractContextManager[None]:
    return fast_tier.watching(item.nodeid) if fast_tier.in_fast_tier(item) else nullcontext()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with _guard(item):
        return (yield)

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
