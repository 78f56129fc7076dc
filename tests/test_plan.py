"""`pretrain plan` against hand-computed values (the seed's 466 interruptions in 54 days)."""

from __future__ import annotations

import json
import subprocess

import pytest

from pretrain.commands.plan import daly_interval, goodput, mtbf_from_failures, plan_capacity, plan_tier, young_interval
from tests.helpers import PYTHON

M = 10012.017167  # 54 days * 86400 s / 466 interruptions (the job uses the whole cluster)


def test_mtbf_from_a_failure_record() -> None:
    assert mtbf_from_failures(466, 54, 16384, 16384) == pytest.approx(M)
    # A 1,024-GPU job on that fleet fails 16x less often.
    assert mtbf_from_failures(466, 54, 16384, 1024) == pytest.approx(160192.27, rel=1e-6)
    with pytest.raises(ValueError):
        mtbf_from_failures(0, 54, 16384, 1024)


def test_young_and_daly_intervals() -> None:
    assert young_interval(30, M) == pytest.approx(775.0620, rel=1e-6)  # sqrt(2 * 30 * 10012)
    assert daly_interval(30, M) == pytest.approx(755.1910, rel=1e-6)
    assert daly_interval(30_000, 10_000) == 10_000  # delta >= 2M: checkpoint every MTBF
    assert goodput(755.1910, 30, 300, M) == pytest.approx(0.892597, abs=1e-6)


def test_tier_plan_and_capacity() -> None:
    t = plan_tier("local", 30, 240, M, step_s=2.5, detect_restart_s=60)
    assert t.interval_steps == round(755.1910 / 2.5) == 302
    assert t.goodput == pytest.approx(0.892597, abs=1e-6)
    c = plan_capacity(8e9, nodes=4, local_keep=2, replication_factor=2, staging_keep=2, s3_keep=5, headroom=0.25)
    assert c.bytes_per_param == 14 and c.checkpoint_bytes == 112e9
    assert c.per_node_tier1_bytes == pytest.approx(140e9)  # 112/4 * 2 * 2 * 1.25
    assert c.staging_bytes == pytest.approx(280e9) and c.s3_bytes == pytest.approx(700e9)


def test_cli() -> None:
    out = subprocess.run(
        [
            PYTHON, "-m", "pretrain", "plan",
            "--failures", "466", "--days", "54", "--cluster-gpus", "16384", "--job-gpus", "16384",
            "--tier", "local:30:240", "--tier", "s3:300:1800", "--step-seconds", "2.5",
            "--params", "8e9", "--nodes", "4", "--json",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["mtbf_seconds"] == pytest.approx(M)
    local, s3 = data["tiers"]
    assert local["daly_interval_s"] == pytest.approx(755.1910, rel=1e-6) and local["interval_steps"] == 302
    assert s3["daly_interval_s"] > local["daly_interval_s"] and s3["goodput"] < local["goodput"]
    assert data["capacity"]["checkpoint_bytes"] == 112e9
    bad = subprocess.run([PYTHON, "-m", "pretrain", "plan", "--tier", "local:30:240"], capture_output=True, text=True)
    assert bad.returncode == 2 and "give --mtbf-hours or --failures" in bad.stderr
