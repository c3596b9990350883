"""The dependency rule of ARCHITECTURE.md, checked by import-linter's contracts in pyproject.toml.

The first test runs the contracts on the service; the others prove they bite, on throwaway
packages laid out like the service: one whose exporter imports the orchestrator, one whose
export format imports another format.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

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
    assert "4 kept, 0 broken" in result.stdout, result.stdout


def _fake_service(root: Path, layout: dict[str, str]) -> None:
    for rel, text in layout.items():
        (root / "fakesvc" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "fakesvc" / rel).write_text(text)


def _contract(contract_id: str) -> dict[str, Any]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    found: dict[str, Any] = next(c for c in contracts["contracts"] if c["id"] == contract_id)
    return found


def test_contracts_fail_when_an_exporter_imports_the_orchestrator(tmp_path: Path) -> None:
    _fake_service(tmp_path, {
        "__init__.py": "",
        "exporters/__init__.py": "",
        "exporters/gguf.py": "from fakesvc.jobs import pipeline\n",  # the violation
        "jobs/__init__.py": "",
        "jobs/pipeline.py": "from fakesvc.exporters import gguf\n",
    })  # fmt: skip
    stage_contract = _contract("stages")
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


def test_contracts_fail_when_a_format_imports_another_format(tmp_path: Path) -> None:
    _fake_service(tmp_path, {
        "__init__.py": "",
        "exporters/__init__.py": "",
        "exporters/common/__init__.py": "",
        "exporters/common/child_process.py": "",
        "exporters/nnef/__init__.py": "",
        "exporters/nnef/exporter.py": "from fakesvc.exporters.common import child_process\n",
        "exporters/onnx/__init__.py": "",
        "exporters/onnx/exporter.py": "from fakesvc.exporters.nnef import exporter\n",  # the violation
    })  # fmt: skip
    formats = _contract("formats")
    assert formats["type"] == "independence"
    assert {"service.exporters.nnef", "service.exporters.onnx"} <= set(formats["modules"])
    fake = [m.replace("service.", "fakesvc.") for m in formats["modules"]]
    _fake_service(tmp_path, {
        m.removeprefix("fakesvc.").replace(".", "/") + "/__init__.py": "" for m in fake
    })  # fmt: skip
    config = tmp_path / ".importlinter"
    config.write_text("\n".join([
        "[importlinter]",
        "root_package = fakesvc",
        "[importlinter:contract:formats]",
        f"name = {formats['name']}",
        "type = independence",
        "modules =",
        *(f"    {m}" for m in fake),
    ]) + "\n")  # fmt: skip
    result = _lint(config, tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout
    assert "fakesvc.exporters.onnx.exporter -> fakesvc.exporters.nnef.exporter" in result.stdout, (
        result.stdout
    )


def test_every_root_module_and_package_of_the_service_is_in_the_layers() -> None:
    """A module or package added at service/'s root without a place in the layers contract
    would be outside the dependency rule: each is named there exactly once."""
    layers = _contract("layers")["layers"]
    named = [
        name.strip().removeprefix("service.")
        for layer in layers for name in layer.replace("|", ":").split(":")
    ]
    service = ROOT / "service"
    on_disk = {p.stem for p in service.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in service.iterdir() if (p / "__init__.py").is_file()
    }
    assert sorted(named) == sorted(set(named)), f"named twice: {named}"
    assert set(named) == on_disk, (
        f"not in the layers contract: {sorted(on_disk - set(named))}; "
        f"in it but not on disk: {sorted(set(named) - on_disk)}"
    )
