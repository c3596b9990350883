"""Writes tests/durations.json, each test module's seconds in one full run, from that run's
JUnit XML (``pytest --junitxml=run.xml``): ``python scripts/test_weights.py run.xml``.

Why a file: ``make test`` runs on two pytest-xdist workers, each taking one whole module at a
time as it frees up. The run ends when the later worker ends, so the heaviest modules go first
(longest first, the greedy schedule that ends within 4/3 of the best), and only a measurement
knows which are heaviest: test counts do not (one module of 21 tests took 626 s, another of 60
took 2 s). A stale file costs balance, never a test: a module it lacks counts as the median.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "durations.json"


def module_of(classname: str) -> str:
    """JUnit's ``tests.e2e.test_cli`` or ``tests.e2e.test_cli.TestClass`` -> the module's path."""
    parts = classname.split(".")
    while parts and not (ROOT / Path(*parts)).with_suffix(".py").is_file():
        parts.pop()
    return str(Path(*parts).with_suffix(".py")) if parts else ""


def main(xml_path: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(xml_path).iter("testcase"):
        module = module_of(case.get("classname", ""))
        if module:
            seconds[module] += float(case.get("time", "0"))
    weights = {m: round(s, 1) for m, s in sorted(seconds.items())}
    with tempfile.NamedTemporaryFile("w", dir=OUT.parent, delete=False, suffix=".tmp") as f:
        json.dump(weights, f, indent=1)
        f.write("\n")
    os.replace(f.name, OUT)
    print(f"{OUT.relative_to(ROOT)}: {len(weights)} modules, {sum(weights.values()) / 60:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1])
