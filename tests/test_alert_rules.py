"""The alert rules: `promtool check rules` and the rule unit tests in monitoring/alerts.test.yaml
(including the seed's rule: newest committed checkpoint older than 2x its planned interval)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import REPO


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool missing: install Debian's prometheus (scripts/install-system-deps.sh)")
    return tool


def test_rules_are_valid() -> None:
    out = subprocess.run(
        [_promtool(), "check", "rules", "alerts.yaml"], cwd=REPO / "monitoring", capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout


def test_rule_unit_tests_pass() -> None:
    out = subprocess.run(
        [_promtool(), "test", "rules", "alerts.test.yaml"], cwd=REPO / "monitoring", capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_broken_expectation_fails(tmp_path) -> None:  # noqa: ANN001
    """promtool really evaluates the rules: an expectation the data contradicts fails."""
    text = (REPO / "monitoring" / "alerts.test.yaml").read_text().replace("eval_time: 2m", "eval_time: 5m", 1)
    (tmp_path / "alerts.yaml").write_text((REPO / "monitoring" / "alerts.yaml").read_text())
    (tmp_path / "t.yaml").write_text(text)
    out = subprocess.run([_promtool(), "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and "CheckpointStale" in out.stdout + out.stderr
