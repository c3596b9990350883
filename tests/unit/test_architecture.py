"""The dependency rule of ARCHITECTURE.md, checked by import-linter's contracts in pyproject.toml.

The first test runs the contracts on the service; the others prove they bite, on throwaway
packages laid out like the service: one whose exporter imports the orchestrator, one whose
export format imports another format, one with a format the contract does not name, one with
an import cycle; and that the layers name every root module and the contract's one list of
formats is the packages on disk.
"""

from __future__ import annotations

import json
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


def _lint_with(contract: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the fake service with one of the service's contracts, its module
    names moved from ``service`` to ``fakesvc`` (a TOML config: the values are JSON's)."""
    lines = ["[tool.importlinter]", 'root_package = "fakesvc"', "",
             "[[tool.importlinter.contracts]]"]  # fmt: skip
    def fake(module: str) -> str:
        if module == "service" or module.startswith("service."):
            return "fakesvc" + module.removeprefix("service")
        return module

    for key, value in contract.items():
        if isinstance(value, list) and key != "layers":  # layers are relative to containers
            value = [fake(v) for v in value]
        lines.append(f"{key} = {json.dumps(value)}")
    config = tmp_path / "fake.toml"
    config.write_text("\n".join(lines) + "\n")
    return _lint(config, tmp_path, tmp_path)


def _format_packages(contract: dict[str, Any]) -> set[str]:
    """The format packages the ``formats`` contract names (its top layer, independent ones)."""
    return {name.strip() for name in contract["layers"][0].split("|")}


def _fake_exporters(root: Path, formats: set[str], files: dict[str, str]) -> None:
    """A fake ``exporters`` package: base, common and ``formats``, each empty but ``files``."""
    layout = {"__init__.py": "", "exporters/__init__.py": "", "exporters/base.py": "",
              "exporters/common/__init__.py": "", "exporters/common/child_process.py": ""}  # fmt: skip
    layout |= {f"exporters/{name}/__init__.py": "" for name in formats}
    _fake_service(root, layout | files)


def test_contracts_fail_when_a_format_imports_another_format(tmp_path: Path) -> None:
    formats = _contract("formats")
    assert formats["containers"] == ["service.exporters"]
    assert {"nnef", "onnx"} <= _format_packages(formats)
    _fake_exporters(tmp_path, _format_packages(formats), {
        "exporters/nnef/exporter.py": "from fakesvc.exporters.common import child_process\n",
        "exporters/onnx/exporter.py": "from fakesvc.exporters.nnef import exporter\n",  # the violation
    })  # fmt: skip
    result = _lint_with(formats, tmp_path)
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


def test_contracts_fail_when_common_imports_a_format(tmp_path: Path) -> None:
    formats = _contract("formats")
    _fake_exporters(tmp_path, _format_packages(formats), {
        "exporters/gguf/exporter.py": "",
        "exporters/common/child_process.py": "from fakesvc.exporters.gguf import exporter\n",
    })  # fmt: skip
    result = _lint_with(formats, tmp_path)
    assert result.returncode != 0, result.stdout
    assert "fakesvc.exporters.common.child_process -> fakesvc.exporters.gguf.exporter" in (
        result.stdout
    ), result.stdout


def test_contracts_fail_for_a_format_package_they_do_not_name(tmp_path: Path) -> None:
    """``exhaustive``: a new package under ``exporters`` is a lint failure until the contract's
    one list names it, so that no format escapes the rule that none imports another."""
    formats = _contract("formats")
    assert formats["exhaustive"] is True
    _fake_exporters(tmp_path, _format_packages(formats) | {"toy"}, {})
    result = _lint_with(formats, tmp_path)
    assert result.returncode != 0, result.stdout
    assert "fakesvc.exporters.toy" in result.stdout, result.stdout


def test_the_formats_contract_and_the_registry_name_exactly_the_export_packages_on_disk() -> None:
    """The two lines a format adds outside its package: its name in the contract's list, and
    its import in ``service/exporters/__init__.py`` (which registers it)."""
    from service.exporters import registry

    formats = _contract("formats")
    exporters = ROOT / "service" / "exporters"
    on_disk = {p.parent.name for p in exporters.glob("*/__init__.py")} - {"common"}
    assert _format_packages(formats) == on_disk
    assert [layer.strip() for layer in formats["layers"][1:]] == ["common", "base"]
    assert set(registry()) == on_disk, "a format package is not imported by service.exporters"


def test_contracts_fail_on_an_import_cycle_between_sibling_modules(tmp_path: Path) -> None:
    """``acyclic_siblings`` sees a cycle closed by a function-level import, the kind that hid
    ``gguf.lora -> gguf.exporter``."""
    acyclic = _contract("acyclic")
    assert acyclic["type"] == "acyclic_siblings" and acyclic["ancestors"] == ["service"]
    _fake_service(tmp_path, {
        "__init__.py": "",
        "gguf/__init__.py": "",
        "gguf/exporter.py": "from fakesvc.gguf import lora\n",
        "gguf/lora.py": "def export():\n    from fakesvc.gguf import exporter\n",  # the cycle
    })  # fmt: skip
    result = _lint_with(acyclic, tmp_path)
    assert result.returncode != 0, result.stdout
    assert "No cycles are allowed in fakesvc.gguf" in result.stdout, result.stdout
