"""`make demo`'s job: 2 ranks under ft_launcher, one SIGKILL, automatic recovery, a summary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretrain.commands.demo import memory_dir
from tests.helpers import run_verb

pytestmark = pytest.mark.slow


def test_demo_recovers_and_prints_summary(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    try:
        proc = run_verb(tmp_path, "demo", work, timeout=240)
    finally:  # a demo killed by the timeout cannot give its tier-0 slots back itself
        leftover = memory_dir(work.resolve())
        existed = leftover.exists()
        shutil.rmtree(leftover, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for label in (
        "failure at step",
        "checkpoint step restored",
        "lost steps",
        "restore seconds",
        "steps/s before failure",
        "steps/s after recovery",
    ):
        assert label in proc.stdout
    summary = json.loads((work / "recovery-summary.json").read_text())
    assert summary["final_step"] == 160 and summary["attempts"] == 2
    (rec,) = summary["recoveries"]
    # Tier 0 every step: the restored step is the last one done (96) or the one before it.
    assert (rec["failure_step"], rec["restored_tier"]) == (97, "memory"), rec
    assert (rec["restored_step"], rec["lost_steps"]) in ((96, 0), (95, 1)), rec
    assert not existed, "the demo gives its tmpfs slots back"
    assert rec["restore_seconds"] > 0 and rec["failure_to_first_step_seconds"] > 0
    # All three tiers: the uploader promoted the reshardable steps (a staging save still in flight
    # when rank 1 is killed at step 97 would be lost; 120 and 160 are written after the restart).
    assert {40, 120, 160} <= set(summary["s3_steps"]), summary["s3_steps"]
    assert "steps promoted to tier 3" in proc.stdout
    # Real text, a BPE tokenizer trained at demo time: validation before and after the failure,
    # falling, and ending clearly below the unigram entropy of the data under that tokenizer.
    val = {int(k): v for k, v in summary["validation_loss"].items()}
    assert sorted(val) == [40, 80, 120, 160] and val[160] < val[40]
    assert val[160] < summary["unigram_entropy"] - 0.3, (val, summary["unigram_entropy"])
    assert "validation loss, step 160" in proc.stdout and "unigram entropy of the data" in proc.stdout
