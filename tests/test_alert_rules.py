"""The alert rules: `promtool check rules` and the rule unit tests in monitoring/alerts.test.yaml:
every alert has a test in which it fires, and each of those expectations can fail (promtool
really evaluates the rules against the series)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

RULES = yaml.safe_load((REPO / "monitoring" / "alerts.yaml").read_text())
TESTS = yaml.safe_load((REPO / "monitoring" / "alerts.test.yaml").read_text())
ALERTS = sorted({r["alert"] for g in RULES["groups"] for r in g["rules"]})


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool missing: install Debian's prometheus (scripts/install-system-deps.sh)")
    return tool


def _run_tests(tests: dict, where: Path) -> subprocess.CompletedProcess[str]:
    (where / "alerts.yaml").write_text((REPO / "monitoring" / "alerts.yaml").read_text())
    (where / "t.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run([_promtool(), "test", "rules", "t.yaml"], cwd=where, capture_output=True, text=True)


def test_rules_are_valid() -> None:
    out = subprocess.run(
        [_promtool(), "check", "rules", "alerts.yaml"], cwd=REPO / "monitoring", capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in RULES['groups'])} rules found" in out.stdout


def test_rule_unit_tests_pass() -> None:
    out = subprocess.run(
        [_promtool(), "test", "rules", "alerts.test.yaml"], cwd=REPO / "monitoring", capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_test_where_it_fires() -> None:
    fired = {t["alertname"] for case in TESTS["tests"] for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    assert fired == set(ALERTS)


@pytest.mark.parametrize("alert", ALERTS)
def test_each_firing_expectation_can_fail(alert: str, tmp_path: Path) -> None:
    """Expecting silence where the data makes the alert fire fails: the test is not vacuous. Only the
    case holding that expectation is evaluated (the whole file passes in test_rule_unit_tests_pass):
    promtool's cost is the evaluation of every case's series, ~1.5 s of CPU for the whole file."""
    tests = copy.deepcopy(TESTS)
    case, check = next(
        (case, t)
        for case in tests["tests"]
        for t in case["alert_rule_test"]
        if t["alertname"] == alert and t["exp_alerts"]
    )
    check["exp_alerts"] = []
    out = _run_tests({**tests, "tests": [case]}, tmp_path)
    assert out.returncode != 0 and alert in out.stdout + out.stderr


def test_no_rule_text_says_the_seed() -> None:
    assert "seed" not in (REPO / "monitoring" / "alerts.yaml").read_text().lower()


def test_severities_are_the_ones_kube_prometheus_stack_routes() -> None:
    """Its default inhibit rules and the usual Alertmanager routes key on critical/warning/info."""
    severities = {r["labels"]["severity"] for g in RULES["groups"] for r in g["rules"]}
    assert severities <= {"critical", "warning", "info"} and "critical" in severities


def test_every_alert_that_fires_names_its_run_or_pod() -> None:
    """Two runs on one Prometheus: each alert says which run (or which pod) it is about, so neither
    masks nor merges the other (an unlabelled absent() did both)."""
    for case in TESTS["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                labels = alert["exp_labels"]
                assert "run_id" in labels or {"namespace", "pod"} <= set(labels), (check["alertname"], labels)
    for group in RULES["groups"]:
        for rule in group["rules"]:
            assert "absent(" not in rule["expr"] and "absent_over_time(" not in rule["expr"], rule["alert"]
