"""The project's heartbeat: a SIGKILLed run resumes bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.dp_slices import SPLIT_KEY
from tests.helpers import events, ft_launch, full_tensors, kill_rank_at, metrics_by_step, overrides_for, torchrun

pytestmark = pytest.mark.slow


def test_sigkill_at_step_37_resumes_bit_exact(tmp_path: Path, corpus: Path) -> None:
    common = {"train.steps": 60, "checkpoint.local.interval": 10, "checkpoint.reshardable.interval": 20}
    base = tmp_path / "baseline"
    torchrun(base, 2, overrides_for(base, corpus, **common))

    crash = tmp_path / "crash"
    ft_launch(crash, 2, overrides_for(crash, corpus, **common, **kill_rank_at(1, 37)))

    ev = events(crash / "runs" / "t")
    faults = [e for e in ev if e["event"] == "fault_injected"]
    restores = [e for e in ev if e["event"] == "restore"]
    assert [(f["rank"], f["step"]) for f in faults] == [(1, 37)]
    assert [(r["step"], r["tier"]) for r in restores] == [(30, "local")], "the restarted group must restore step 30"
    assert [row["tier"] for row in restores[0]["per_rank"]] == ["local", "local"]
    assert restores[0]["rng_restored"] is True
    assert len({e["attempt"] for e in ev if e["event"] == "start"}) == 2

    b = metrics_by_step(base / "runs" / "t")
    r = metrics_by_step(crash / "runs" / "t")
    assert sorted(b) == sorted(r) == list(range(1, 61))
    for step in range(31, 61):
        assert r[step]["loss"] == b[step]["loss"], f"loss differs at step {step}"
        assert r[step]["grad_norm"] == b[step]["grad_norm"], f"grad norm differs at step {step}"
        assert r[step]["lr"] == b[step]["lr"]
    # The first step after the restore is 31 in the new attempt (never 0).
    second = [rec for rec in (crash / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert '"step": 31' in next(line for line in second if restores[0]["attempt"] in line)

    final_b = full_tensors(base / "reshard" / "t" / "steps" / "step-000000060" / "model")
    final_r = full_tensors(crash / "reshard" / "t" / "steps" / "step-000000060" / "model")
    assert final_b.keys() == final_r.keys()
    assert any(k.startswith("optimizer.state.exp_avg.") for k in final_b)
    for key in final_b:
        assert torch.equal(final_b[key], final_r[key]), f"final {key} differs"
    # Issue 45 #10: at DP 2 each rank's tier-1 steps (the restored one was one) hold half of the weights.
    shares = [
        torch.load(p, weights_only=True, mmap=True) for p in sorted(crash.glob("ckpt/t/ranks/*/steps/*/state.pt"))
    ]
    assert len(shares) >= 2 and all("model" not in s and s[SPLIT_KEY]["dp"] == 2 for s in shares)
    assert sorted({s[SPLIT_KEY]["dp_rank"] for s in shares}) == [0, 1]


def test_hung_rank_is_detected_by_heartbeats_and_the_group_restarts(tmp_path: Path, corpus: Path) -> None:
    from pretrain.commands.ft_command import ft_launcher_command
    from tests.helpers import REPO, TINY, run

    job = tmp_path / "hang"
    ov = overrides_for(
        job,
        corpus,
        **{
            "train.steps": 40,
            "checkpoint.local.interval": 10,
            "fault_tolerance.inject.hang_rank": 1,
            "fault_tolerance.inject.hang_at_step": 25,
        },
    )
    cmd = ft_launcher_command(
        TINY, nproc=2, ft_config=REPO / "tests" / "ft-fast-hang.yaml", max_restarts=2, overrides=ov
    )
    proc = run(cmd, job, timeout=300, check=True)
    ev = events(job / "runs" / "t")
    assert [(e["rank"], e["signal"]) for e in ev if e["event"] == "fault_injected"] == [(1, "hang")]
    # One restart, for the hang: the final saves (seconds on a loaded machine, heartbeats still
    # sent) are not taken for another one.
    assert [(r["step"], r["tier"]) for r in ev if r["event"] == "restore"] == [(20, "local")]
    assert [e["launcher_restart_count"] for e in ev if e["event"] == "start"] == [0, 1]
    assert max(metrics_by_step(job / "runs" / "t")) == 40
    # Found by the heartbeat timeout of tests/ft-fast-hang.yaml (6 s), not by a collective timeout.
    assert "Did not get subsequent heartbeat. Waited 6.00 seconds." in proc.stdout + proc.stderr


@pytest.mark.parametrize("ft_config", ["tests/ft-sections.yaml", "configs/ft-cpu.yaml"])
def test_sections_a_slow_save_is_not_a_hang_and_a_native_hang_is(tmp_path: Path, corpus: Path, ft_config: str) -> None:
    """Sections: a save 7 s long (step timeout 5 s before it is measured, in the test's config) passes;
    a rank stuck in native code (libc pause) is killed by the measured step timeout, not by the
    60 s heartbeat of the shipped CPU default, and the group restarts with the measured timeouts
    loaded from the checkpoint."""
    from pretrain.commands.ft_command import ft_launcher_command
    from tests.helpers import REPO, TINY, run

    job = tmp_path / "sections"
    ov = overrides_for(
        job,
        corpus,
        **{
            "train.steps": 50,
            "checkpoint.local.interval": 10,
            "checkpoint.reshardable.interval": 100,
            "fault_tolerance.calculate_timeouts_after": 12,
            "fault_tolerance.inject.slow_save_at_step": 20,
            "fault_tolerance.inject.slow_save_seconds": 7,
            "fault_tolerance.inject.hang_rank": 1,
            # Six steps after the save of step 30 starts: under the suite's load its writer and
            # publish took more than the three steps a hang at 33 left (the restore was then step 20).
            "fault_tolerance.inject.hang_at_step": 36,
            "fault_tolerance.inject.hang_native": "true",
        },
    )
    cmd = ft_launcher_command(TINY, nproc=2, ft_config=REPO / ft_config, max_restarts=2, overrides=ov)
    proc = run(cmd, job, timeout=300, check=True)
    ev = events(job / "runs" / "t")
    starts = [e for e in ev if e["event"] == "start"]
    assert len(starts) == 2, "the slow save must not restart the group; the hang must"
    assert [(r["step"], r["tier"]) for r in ev if r["event"] == "restore"] == [(30, "local")]
    measured = [e for e in ev if e["event"] == "ft_timeouts" and e["source"] == "measured"]
    loaded = [e for e in ev if e["event"] == "ft_timeouts" and e["source"] == "checkpoint"]
    assert measured and loaded and loaded[0]["timeouts"] == measured[0]["timeouts"]
    step_timeout = measured[0]["timeouts"]["current_timeouts"]["section"]["section"]["step"]
    assert step_timeout > 0
    # Found by the measured step timeout (the rank monitors say which timeout elapsed, and its
    # value), not by a heartbeat timeout: however slow the machine, whatever was measured.
    launcher = proc.stdout + proc.stderr
    elapsed = re.findall(r"Section 'step' has been open for [\d.]+ seconds\. Timeout is ([\d.]+) seconds", launcher)
    assert elapsed and set(elapsed) == {f"{step_timeout:.2f}"}, (elapsed, step_timeout)
    assert "Did not get subsequent heartbeat" not in launcher
    assert max(metrics_by_step(job / "runs" / "t")) == 50
