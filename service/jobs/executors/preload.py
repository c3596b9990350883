"""What the job forkserver imports before it forks any job, derived rather than listed by hand
(the forkserver imports :mod:`.freeze_preload`, which calls :func:`preload` and freezes the heap).

A job runs :func:`service.jobs.runner.run_job`. The stages keep torch
and friends out of the API process with function-level imports, so importing the runner alone
leaves most of a job's modules to the job. They are found from the source, not listed:

1. starting at the runner, every ``service.*`` module named by an ``import`` statement anywhere
   in a module's source, top-level or inside a function (read with :mod:`ast`: milliseconds,
   nothing imported to find them), followed from module to module;
2. except inside exporter modules (``service.exporters.*``), whose function-level imports are
   not followed: each exporter declares with :meth:`Exporter.modules` which of its lazy imports
   a job should find preloaded, so that a format few jobs use (torch-to-nnef, onnxscript)
   costs the forkserver, and every job forked from it, no memory;
3. and never the schema migrations (``_NOT_IN_A_JOB``), which no job runs;
4. plus the model code most jobs build (``service.offload.build.COMMON_MODEL_MODULES``).

A module that fails to import is left to the job that needs it (and fails there, typed).
tests/unit/jobs/test_preload.py runs a real job in a forked child and fails if the job
imported anything heavy that was not preloaded.
"""

from __future__ import annotations

import ast
import importlib
import logging
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

ENTRY = "service.jobs.runner"
"""What a job process runs (:func:`service.jobs.executors.process.spawn_job_process`)."""

_ROOT = Path(__file__).resolve().parents[3]  # the directory holding the ``service`` package
_OPAQUE = "service.exporters."
"""Modules whose function-level imports are not followed (see rule 2 above)."""
_NOT_IN_A_JOB = frozenset({"service.jobs.store.migrations"})
"""Reachable but never run by a job: the schema is migrated by the service and the workers at
start-up (alembic and mako would add 10 MiB to every job process)."""


def _source_of(module: str) -> Path | None:
    """The source file of ``service.*`` module ``module``, found without importing it."""
    base = _ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_in(module: str, path: Path) -> Iterable[str]:
    """The ``service.*`` modules that ``module``'s source imports (function-level imports of
    exporter modules excepted)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    nodes: Iterable[ast.AST] = tree.body if module.startswith(_OPAQUE) else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            # ``from service.offload import store``: a submodule, not a name in a package
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def service_modules(entries: Iterable[str]) -> list[str]:
    """Every ``service.*`` module reachable from ``entries`` by rules 1 and 2, in the order
    found (a module before the ones it leads to)."""
    found: list[str] = []
    seen: set[str] = set()
    queue = [m for m in entries if m.startswith("service.")]
    while queue:
        module = queue.pop(0)
        if module in seen or module in _NOT_IN_A_JOB:
            continue
        seen.add(module)
        path = _source_of(module)
        if path is None:
            continue  # a name imported from a module, not a module
        found.append(module)
        queue.extend(m for m in _imports_in(module, path) if m.startswith("service."))
    return found


def job_modules() -> list[str]:
    """What a job imports, by the rules above; third-party modules come with the ``service.*``
    modules that import them at top level."""
    from service.exporters import registry
    from service.offload.build import COMMON_MODEL_MODULES

    declared = [m for exporter in registry().values() for m in exporter.modules()]
    return [*service_modules([ENTRY, *declared]), *COMMON_MODEL_MODULES]


def preload() -> list[str]:
    """Import :func:`job_modules`; the names that failed (left to the jobs)."""
    failed = []
    for module in job_modules():
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a module that cannot load is the job's to report
            failed.append(module)
    if failed:
        log.warning("not preloaded (a job importing them will say why): %s", ", ".join(failed))
    return failed
