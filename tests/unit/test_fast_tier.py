"""The fast tier's guard bites: a test under tests/unit cannot use the built llama.cpp, tract, a
model package or the real-model corpus, and a refusal the code swallows still fails the test."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from service.shims.llama_cpp import default_bin_dir
from tests.fixtures import fast_tier
from tests.fixtures.fast_tier import FastTierViolation
from tests.fixtures.real_models import REAL_MODELS, real_model


def test_this_test_is_in_the_fast_tier(request: pytest.FixtureRequest) -> None:
    assert fast_tier.in_fast_tier(request.node)
    assert fast_tier.UNIT_DIR == Path(__file__).resolve().parent


def test_opening_a_file_of_the_built_llama_cpp_is_refused() -> None:
    with fast_tier.refused():
        (default_bin_dir().parent / "VERSION").read_text()  # refused before the OS looks


def test_running_a_llama_cpp_tool_is_refused() -> None:
    with fast_tier.refused():
        subprocess.run([str(default_bin_dir() / "llama-quantize"), "--help"], check=False)


@pytest.mark.parametrize("program", ["tract", "docker", "chromium"])
def test_starting_tract_docker_or_chromium_is_refused(program: str) -> None:
    with fast_tier.refused():
        subprocess.run([program, "--version"], check=False)


def test_running_the_tract_command_with_python_is_refused() -> None:
    with fast_tier.refused():
        subprocess.run([sys.executable, "service/exporters/nnef/tract_cli.py", "--version"], check=False)


@pytest.mark.parametrize("module", ["tract", "conversion.base", "playwright.sync_api"])
def test_importing_a_tools_module_is_refused(module: str) -> None:
    with fast_tier.refused():  # the event an import raises when the module is not loaded yet
        sys.audit("import", module, None, sys.path, sys.meta_path, sys.path_hooks)


def test_reading_a_model_packages_files_is_refused() -> None:
    dist = importlib.metadata.distribution(REAL_MODELS["minilm"].packages[0])
    weights = next(f for f in dist.files or [] if f.name.endswith(".safetensors"))
    with fast_tier.refused():
        Path(str(dist.locate_file(weights))).read_bytes()


@pytest.mark.parametrize("name", ["minilm", "smollm2"])  # a package as is; a built one
def test_a_real_model_is_refused_before_it_is_read_or_built(name: str) -> None:
    with fast_tier.refused():
        real_model(name)


def test_a_refusal_the_code_swallows_still_fails_the_test() -> None:
    with (
        pytest.raises(FastTierViolation, match="the built llama.cpp"),
        fast_tier.watching("a test that swallows"),
    ):
        try:
            (default_bin_dir() / "llama-quantize").read_bytes()
        except FastTierViolation:
            pass  # code under test that catches everything
