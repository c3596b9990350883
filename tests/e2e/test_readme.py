"""The README as a newcomer uses it: its quickstart block, pasted as it is into an empty
directory, prepares a real checkpoint and downloads the artifacts; the generated reference pages
match the code; every link of the README and docs/ leads somewhere."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures.waiting import eventually

REPO = Path(__file__).parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"


def quickstart_block() -> str:
    """The shell block between the README's quickstart markers."""
    text = README.read_text()
    found = re.search(r"<!-- quickstart[^>]*-->\s*```sh\n(.*?)```\s*<!-- /quickstart -->", text,
                      re.DOTALL)
    assert found, "README.md has no <!-- quickstart --> ... <!-- /quickstart --> sh block"
    return found.group(1)


def test_the_quickstart_block_runs_verbatim_and_downloads_the_artifacts(tmp_path: Path) -> None:
    """In a network namespace of its own (port 8000 is free there, and nothing outside can be
    reached: the quickstart needs no network), with the installed ``modelprep`` on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELPREP_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    script = "set -e\n" + quickstart_block()
    result = subprocess.run(
        ["unshare", "--net", "--map-root-user", "bash", "-c",
         'ip link set lo up && exec bash -c "$0"', script],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    log = tmp_path / "service.log"
    assert result.returncode == 0, (
        f"{result.stdout}\n{result.stderr}\n{log.read_text()[-3000:] if log.exists() else ''}"
    )
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest["files"]
    assert any(f["path"].endswith("model.safetensors") for f in files), files
    for entry in files:
        data = (out / entry["path"]).read_bytes()
        assert len(data) == entry["size"], entry["path"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["path"]
    # `kill %1` stopped the service it started
    eventually(lambda: "Finished server process" in log.read_text(),
               what="the quickstart's service stopped", context=lambda: log.read_text()[-2000:])


def test_the_generated_reference_pages_are_current() -> None:
    from service.api.problems import markdown
    from service.config import settings_reference

    assert (DOCS / "settings.md").read_text() == settings_reference(), (
        "docs/settings.md is stale: run `modelprep reference settings > docs/settings.md`"
    )
    assert (DOCS / "errors.md").read_text() == markdown(), (
        "docs/errors.md is stale: run `modelprep reference errors > docs/errors.md`"
    )


def test_every_setting_is_described() -> None:
    from service.config import Settings

    bare = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not bare, f"settings without a description (docs/settings.md shows them): {bare}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_of_the_readme_and_docs_leads_somewhere() -> None:
    pages = [README, *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"(?m)^#+ (.+)$", linked.read_text())
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_reads_in_five_minutes() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 120, len(lines)
    assert max(len(line) for line in lines) <= 200
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## Two commands", "## Quickstart"], headings
