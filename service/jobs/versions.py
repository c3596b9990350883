"""The versions of what produces and checks artifacts: part of the reuse key
(:mod:`service.jobs.reuse`) and of every model card (:mod:`service.jobs.model_card`)."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION

PRODUCERS = (
    "modelprep", "torch", "transformers", "safetensors", "gguf", "sentencepiece",
    "torch-to-nnef", "tract", "onnx", "onnx-ir", "onnxscript", "onnxruntime",
)
"""Distributions whose version can change an artifact's bytes or its verification."""


@functools.cache
def producers() -> dict[str, str | None]:
    """Versions of what produces artifacts; looked up once per process."""
    found: dict[str, str | None] = {}
    for name in PRODUCERS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    found["llama.cpp"] = LLAMA_CPP_PYTHON_VERSION
    return found


def tool_versions() -> dict[str, str | None]:
    """The same versions, for a model card."""
    return dict(producers())
