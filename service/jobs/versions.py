"""The versions of what produces and checks artifacts: part of the reuse key
(:mod:`service.jobs.reuse`) and of every model card (:mod:`service.jobs.model_card`).

Each format declares its own (``Exporter.producers``); what every job runs, whatever its
formats, is :data:`SHARED_PRODUCERS`."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from service.exporters import registry

SHARED_PRODUCERS = ("modelprep", "torch", "transformers", "safetensors")
"""Distributions every job runs (reading the checkpoint, building the model, the independent
reference), whose version can change an artifact's bytes or its verification."""


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


@functools.cache
def producers() -> dict[str, str | None]:
    """Versions of what produces artifacts, the shared ones and every registered format's;
    looked up once per process."""
    exporters = registry().values()
    names = [*SHARED_PRODUCERS, *(d for e in exporters for d in e.producers.distributions)]
    found: dict[str, str | None] = {name: _installed(name) for name in dict.fromkeys(names)}
    for exporter in exporters:
        found.update(exporter.producers.tools)
    return found


def tool_versions() -> dict[str, str | None]:
    """The same versions, for a model card."""
    return dict(producers())
