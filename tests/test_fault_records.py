"""Faults injected from outside the job are recorded as what they were: a SIGSEGV of rank 0 as
"killed by signal 11", a SIGSTOP of rank 1 (a hang, never continued) as a hang of rank 1, each
against the rank that was hit, and the run still ends bit-equal to an uninterrupted one."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.resilience.outside_faults import Fault, PhaseKiller
from tests.helpers import REFERENCE_STEPS, REPO, TINY, metrics_by_step, overrides_for, run

pytestmark = pytest.mark.slow

# Thirty steps of the shared 40-step reference run (its LR schedule: decay over 40).
COMMON = {
    "train.steps": 30,
    "schedule.decay_steps": REFERENCE_STEPS,
    "checkpoint.local.interval": 5,
    "checkpoint.reshardable.interval": 100,
}


def test_a_segfault_and_a_stopped_rank_are_recorded_against_the_rank_hit(
    tmp_path: Path, corpus: Path, reference_40: Path
) -> None:
    """Compared with the session's shared uninterrupted 40-step run (tests/conftest.py), to step 30."""
    job = tmp_path / "job"
    faults = [
        Fault(restart=0, phase="training", ranks=[0], sig=signal.SIGSEGV, after_step=12),
        Fault(restart=None, phase="training", ranks=[1], sig=signal.SIGSTOP, after_step=17),
    ]
    killer = PhaseKiller(job / "runs" / "t", faults)
    killer.start()
    try:
        ft_yaml = REPO / "tests" / "ft-fast-hang.yaml"  # a 6 s heartbeat timeout finds the stopped rank
        cmd = ft_launcher_command(
            TINY, nproc=2, ft_config=ft_yaml, max_restarts=3, overrides=overrides_for(job, corpus, **COMMON)
        )
        run(cmd, job, timeout=400, check=True)
    finally:
        killer.stop()
        killer.join(timeout=5)
    assert killer.error is None and all(f.done for f in faults), (killer.error, faults)
    records = [json.loads(p.read_text()) for p in sorted((job / "runs" / "t" / "attempts").glob("attempt-*.json"))]
    segv, hang = records[0]["failure"], records[1]["failure"]
    assert segv["ranks"] == [0] and "killed by signal 11 (SIGSEGV) during training" in segv["evidence"], segv
    assert hang["ranks"] == [1] and "hung: no sign of life for" in hang["evidence"], hang
    got, want = metrics_by_step(job / "runs" / "t"), metrics_by_step(reference_40)
    assert sorted(got) == list(range(1, 31))
    for step in range(1, 31):
        assert got[step]["loss"] == want[step]["loss"], step
