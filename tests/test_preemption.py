"""Preemption: SIGTERM to the launcher (as Kubernetes sends to PID 1) mid-run -> an emergency tier-1
step is published and the next run resumes from it, or, past the deadline, nothing is published."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.commands.ft_command import ft_launcher_command
from tests.helpers import FT_CPU, PYTHON, TINY, events, job_env, overrides_for, read_jsonl, torchrun

pytestmark = pytest.mark.slow


def _start(tmp: Path, overrides: list[str]) -> subprocess.Popen[str]:
    cmd = ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=2, overrides=overrides)
    tmp.mkdir(parents=True, exist_ok=True)
    log = open(tmp / "job.log", "w")  # noqa: SIM115 - closed when the process ends
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=job_env(tmp), cwd=tmp)


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"job ended early ({proc.returncode})"
        if metrics.exists():
            steps = [rec["step"] for rec in read_jsonl(metrics)]
            if steps and max(steps) >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def _published_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if not p.name.endswith(".tmp"))


def test_sigterm_publishes_an_emergency_step_and_the_next_run_resumes_there(tmp_path: Path, corpus: Path) -> None:
    over = overrides_for(tmp_path, corpus, **{"train.steps": 2000, "checkpoint.reshardable.interval": 1000})
    run_dir = tmp_path / "runs" / "t"
    proc = _start(tmp_path, over)
    _wait_for_step(run_dir / "metrics.jsonl", 13, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)

    ev = events(run_dir)
    preempted = [e for e in ev if e["event"] == "preempted"]
    assert len(preempted) == 1, (tmp_path / "job.log").read_text()[-3000:]
    step = preempted[0]["step"]
    assert preempted[0]["signal"] == "SIGTERM" and preempted[0]["published"] is True
    last_metric = max(rec["step"] for rec in read_jsonl(run_dir / "metrics.jsonl"))
    assert step == last_metric >= 13, "the emergency step is the last step every rank finished"
    for rank in (0, 1):
        steps_dir = tmp_path / "ckpt" / "t" / "ranks" / f"rank-{rank:05d}" / "steps"
        assert step in _published_steps(steps_dir)
        assert (steps_dir / f"step-{step:09d}" / "COMMITTED").exists()
        assert not list(steps_dir.glob("*.tmp*")), "no temporary directory left behind"
    verify = subprocess.run(
        [
            PYTHON,
            "-m",
            "tiering",
            "verify",
            str(tmp_path / "ckpt" / "t" / "ranks" / "rank-00000" / "steps" / f"step-{step:09d}"),
        ],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    record = json.loads((run_dir / "attempts" / "attempt-01.json").read_text())
    assert record["status"] == "preempted" and record["emergency_published"] is True
    assert record["last_step"] == step

    # The rescheduled job resumes from the emergency step, not from the last interval step.
    torchrun(tmp_path / "again", 2, [*over, f"train.steps={step + 3}"])
    restores = [e for e in events(run_dir) if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restores] == [(step, "local")]
    second = json.loads((run_dir / "attempts" / "attempt-02.json").read_text())
    assert second["restored"]["step"] == step and second["status"] == "succeeded"
    assert second["lost_steps"] == 0, "an emergency save loses no step"


def test_sigterm_past_the_deadline_publishes_nothing(tmp_path: Path, corpus: Path) -> None:
    over = overrides_for(
        tmp_path,
        corpus,
        **{
            "train.steps": 2000,
            "checkpoint.reshardable.interval": 1000,
            "checkpoint.local.interval": 1000,
            "fault_tolerance.emergency_save_timeout": 0.001,
        },
    )
    run_dir = tmp_path / "runs" / "t"
    proc = _start(tmp_path, over)
    _wait_for_step(run_dir / "metrics.jsonl", 5, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    for rank in (0, 1):
        steps_dir = tmp_path / "ckpt" / "t" / "ranks" / f"rank-{rank:05d}" / "steps"
        assert _published_steps(steps_dir) == [], "past the deadline nothing may be published"
    record = json.loads((run_dir / "attempts" / "attempt-01.json").read_text())
    assert record["status"] == "preempted", record
    assert "emergency" in record and "not" in record["emergency"] or "did not finish" in record["emergency"]
