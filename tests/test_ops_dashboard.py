"""ops/grafana/renderqueue.json: a dashboard Grafana imports as it is, its rows the ones an
operator reads, every query on the chosen Prometheus and job. That each expression
evaluates and names only series the nodes serve: tests/test_ops_prometheus.py."""

from __future__ import annotations

import json
from typing import Any

from ops_helpers import DASHBOARD

ROWS = (
    "Due and in flight",
    "Lateness",
    "Flow",
    "Keeper trust",
    "Feed lag",
    "Store health",
    "Cluster membership",
    "Fleet's claim rate",
)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_the_dashboard_has_its_rows_in_order_each_with_panels() -> None:
    panels = dashboard()["panels"]
    rows = [panel["title"] for panel in panels if panel["type"] == "row"]
    assert tuple(rows) == ROWS
    kinds = [panel["type"] for panel in panels]
    for at, kind in enumerate(kinds):
        if kind == "row":
            assert at + 1 < len(kinds) and kinds[at + 1] != "row", panels[at]["title"]


def test_every_panel_queries_the_chosen_prometheus_and_job() -> None:
    board = dashboard()
    variables = {variable["name"] for variable in board["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert '$job"' in target["expr"], (panel["title"], target["expr"])
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
