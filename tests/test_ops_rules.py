"""ops/prometheus: the rules load in promtool, and its unit tests (ops/prometheus/tests)
see every alert both fire and stay quiet. The rules against a real Prometheus scraping
real nodes: tests/test_ops_prometheus.py."""

from __future__ import annotations

import subprocess

import yaml
from ops_helpers import RULE_TESTS, RULES, alerts, require_binary


def promtool(*args: str) -> None:
    result = subprocess.run(
        [require_binary("promtool"), *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_rules_and_passes_their_unit_tests() -> None:
    assert RULE_TESTS
    promtool("check", "rules", str(RULES))
    promtool("test", "rules", *map(str, RULE_TESTS))


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases: dict[str, set[bool]] = {}
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    for alert in alerts():
        assert cases.get(alert["alert"]) == {True, False}, alert["alert"]


def test_every_alert_says_what_it_means_and_what_to_look_at() -> None:
    for alert in alerts():
        annotations = alert["annotations"]
        assert annotations["summary"] and "Look at" in annotations["description"], alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
