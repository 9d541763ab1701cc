"""The operator's kit in ops/: its Prometheus rules, its Grafana dashboard, every PromQL
expression they hold, and the Debian binaries (`promtool`, `prometheus`) that check them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import IN_CI

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "ops" / "prometheus" / "renderqueue.rules.yml"
RULE_TESTS = sorted((REPO / "ops" / "prometheus" / "tests").glob("*.yml"))
DASHBOARD = REPO / "ops" / "grafana" / "renderqueue.json"

# Grafana's variables, as a query of the whole fleet reads them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".+", "$instance": ".+"}
SERIES_NAME = re.compile(r"\b(renderqueue_[a-z0-9_]+)\b")


def require_binary(name: str) -> str:
    """The path of a binary of Debian's `prometheus` package: absent, the test skips, except
    under CI=true, where it fails (.ci/run installs the package)."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed (Debian's prometheus package)"
        if IN_CI:
            pytest.fail(f"{message}; .ci/run installs it", pytrace=False)
        pytest.skip(message)
    return found


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def dashboard_expressions() -> dict[str, str]:
    """Every panel target's expression, by panel title and target ref, variables filled in."""
    found: dict[str, str] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found[f"dashboard {panel['title']!r} {target['refId']}"] = expr
    return found


def expressions() -> dict[str, str]:
    """Every expression of the rules and the dashboard, by where it is."""
    found = {
        f"rule {rule.get('alert') or rule['record']}": str(rule["expr"])
        for group in rule_groups()
        for rule in group["rules"]
    }
    found.update(dashboard_expressions())
    return found


def series_named(expr: str) -> set[str]:
    """The node's series an expression reads (recording rules' names have a colon)."""
    return set(SERIES_NAME.findall(expr))
