"""deploy/grafana/modelprep-dashboard.json: well-formed, and it charts every metric the metrics table
of docs/deployment.md lists.

That a query's metric is really exported by a running service is checked against a live scrape
in tests/e2e/test_ui.py (test_the_dashboard_queries_only_metrics_the_service_exports)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "modelprep-dashboard.json"
METRIC = re.compile(r"\bmodelprep_[a-z_]+")


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metric names the panels query (histogram/counter suffixes as written)."""
    return {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in METRIC.findall(target["expr"])
    }


def documented_metrics() -> set[str]:
    """The names in the metrics table of docs/deployment.md: `a_{x,y}_b` expands to two names, a trailing
    `{label,...}` is a label list."""
    names: set[str] = set()
    for line in (ROOT / "docs" / "deployment.md").read_text().splitlines():
        if not line.startswith("| `modelprep_"):
            continue
        cell = line.split("|")[1]
        for written in re.findall(r"`(modelprep_[^`{]*(?:\{[a-z_,]+\}[a-z_]*)?)", cell):
            written = re.sub(r"\{[a-z_,]+\}$", "", written)
            parts = re.split(r"\{([a-z_,]+)\}", written)
            choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
            names.update("".join(c) for c in itertools.product(*choices))
    return names


def test_dashboard_is_an_importable_grafana_dashboard() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "modelprep" and dashboard["title"]
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), f"unbalanced query: {expr}"
            assert METRIC.search(expr), f"query names no modelprep metric: {expr}"


def test_dashboard_charts_every_metric_the_deployment_docs_list() -> None:
    listed = documented_metrics()
    assert len(listed) >= 14, f"docs/deployment.md metrics table not found or changed shape: {listed}"
    charted = {re.sub(r"_(bucket|count|sum)$", "", m) for m in dashboard_metrics(load_dashboard())}
    missing = sorted(m for m in listed if m not in charted)
    assert not missing, f"documented metrics with no dashboard panel: {missing}"
