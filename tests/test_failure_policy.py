"""Failure classification and the restart budget: a deterministic error stops after one
confirmation, repeated failures without progress stop the job, and a checkpoint that produces
NaN right after its restore is quarantined everywhere and the next older step is used."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHON, TINY, events, ft_launch, metrics_by_step, overrides_for

pytestmark = pytest.mark.slow


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]


def test_a_deterministic_user_error_stops_after_one_confirmation(tmp_path: Path, corpus: Path) -> None:
    over = overrides_for(tmp_path, corpus, **{"fault_tolerance.inject.raise_at_step": 5})
    t0 = time.monotonic()
    proc = ft_launch(tmp_path, 2, over, max_restarts=5, check=False)
    assert proc.returncode != 0
    run_dir = tmp_path / "runs" / "t"
    records = _records(run_dir)
    assert len(records) == 2, "one try, one confirmation, then stop (not 6 attempts)"
    for rec in records:
        assert rec["status"] == "failed" and rec["failure"]["classification"] == "user"
        assert "injected user-code error at step 5" in rec["failure"]["exception"]
    stop = json.loads((run_dir / "attempts" / "STOP.json").read_text())
    assert "two attempts in a row" in stop["reason"] and "injected user-code error" in stop["reason"]
    log = (tmp_path / "job.log").read_text()
    assert "not retrying: the same user error ended two attempts in a row" in log
    assert time.monotonic() - t0 < 120

    # A requeue or a pod restart does not start it again: `pretrain launch` refuses in one line.
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    env = {"PATH": os.environ["PATH"], "HOSTNAME": "pretrain-0", "NNODES": "1", "LOCAL_NVME": str(nvme), "RUN_ID": "t"}
    cmd = [
        PYTHON,
        "-m",
        "pretrain",
        "launch",
        "--config",
        str(TINY),
        "--dry-run",
        "--set",
        f"run.dir={tmp_path / 'runs'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "STOP.json: this run was stopped" in lines[0] and "fix:" in lines[0]


def test_failures_without_progress_stop_the_job(tmp_path: Path, corpus: Path) -> None:
    over = overrides_for(
        tmp_path,
        corpus,
        **{
            "fault_tolerance.inject.kill_rank": 1,
            "fault_tolerance.inject.kill_at_step": 3,
            "fault_tolerance.inject.every_attempt": "true",
        },
    )
    proc = ft_launch(tmp_path, 2, over, max_restarts=8, check=False, timeout=400)
    assert proc.returncode != 0
    run_dir = tmp_path / "runs" / "t"
    records = _records(run_dir)
    assert [r["status"] for r in records] == ["failed", "failed", "failed", "stopped"], records
    assert [r["failure"]["rank"] for r in records[:3]] == [1, 1, 1]
    assert all(r["failure"]["classification"] == "infrastructure" for r in records[:3])
    assert "3 attempts in a row failed without committing a new checkpoint" in records[3]["stop_reason"]
    assert (run_dir / "attempts" / "STOP.json").exists()
    status = subprocess.run([PYTHON, "-m", "pretrain", "status", str(run_dir)], capture_output=True, text=True)
    assert status.returncode == 0 and "stopped" in status.stdout and "injected SIGKILL at step 3" in status.stdout


def test_nan_right_after_a_restore_quarantines_that_step_and_falls_back(tmp_path: Path, corpus: Path) -> None:
    over = overrides_for(
        tmp_path,
        corpus,
        **{
            "train.steps": 30,
            "fault_tolerance.inject.kill_rank": 1,
            "fault_tolerance.inject.kill_at_step": 27,
            "fault_tolerance.inject.poison_restored_step": 20,
        },
    )
    ft_launch(tmp_path, 2, over, max_restarts=4)
    run_dir = tmp_path / "runs" / "t"
    ev = events(run_dir)
    assert [(e["step"], e["tier"]) for e in ev if e["event"] == "restore"] == [(20, "local"), (10, "local")]
    poisoned = [e for e in ev if e["event"] == "poisoned_checkpoint"]
    assert [(p["step"], p["at_step"]) for p in poisoned] == [(20, 21)]
    for rank in (0, 1):
        q = tmp_path / "ckpt" / "t" / "ranks" / f"rank-{rank:05d}" / "quarantine"
        reasons = [p.read_text() for p in q.rglob("*") if p.is_file() and "reason" in p.name]
        assert any("suspect checkpoint" in r and "step 21" in r for r in reasons), list(q.rglob("*"))
    records = _records(run_dir)
    # Step 20 exists again, committed by the last attempt from the good step 10, and is no longer suspect.
    for rank in (0, 1):
        again = tmp_path / "ckpt" / "t" / "ranks" / f"rank-{rank:05d}" / "steps" / "step-000000020"
        assert records[-1]["id"] in (again / "manifest.json").read_text()
    assert json.loads((run_dir / "suspect-steps.json").read_text()) == []
    assert records[1]["failure"]["classification"] == "numerical"
    assert records[-1]["status"] == "succeeded" and records[-1]["restored"]["step"] == 10
    m = metrics_by_step(run_dir)
    assert max(m) == 30 and all(m[s]["loss"] == m[s]["loss"] for s in range(1, 31)), "finite losses in the end"
