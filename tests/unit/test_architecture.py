"""The dependency rule of ARCHITECTURE.md, checked by import-linter's contracts in pyproject.toml.

The first test runs the contracts on the service; the second proves they bite, on a throwaway
package laid out like the service whose exporter imports the orchestrator.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lint(config: Path, cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    """import-linter in a child process (its own import graph, its own sys.path)."""
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True, no_logo=True))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_stages_import_neither_the_orchestrator_nor_the_http_layer() -> None:
    result = _lint(ROOT / "pyproject.toml", ROOT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


def test_contracts_fail_when_an_exporter_imports_the_orchestrator(tmp_path: Path) -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    pkg = tmp_path / "fakesvc"
    layout = {
        "__init__.py": "",
        "exporters/__init__.py": "",
        "exporters/gguf.py": "from fakesvc.jobs import pipeline\n",  # the violation
        "jobs/__init__.py": "",
        "jobs/pipeline.py": "from fakesvc.exporters import gguf\n",
    }
    for rel, text in layout.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    stage_contract = next(c for c in contracts["contracts"] if c["id"] == "stages")
    ini = [
        "[importlinter]",
        "root_package = fakesvc",
        "[importlinter:contract:stages]",
        f"name = {stage_contract['name']}",
        "type = forbidden",
        "source_modules = fakesvc.exporters",
        "forbidden_modules = fakesvc.jobs",
    ]
    assert "service.exporters" in stage_contract["source_modules"]
    assert "service.jobs" in stage_contract["forbidden_modules"]
    config = tmp_path / ".importlinter"
    config.write_text("\n".join(ini) + "\n")
    result = _lint(config, tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout
    assert "fakesvc.exporters.gguf -> fakesvc.jobs.pipeline" in result.stdout, result.stdout
