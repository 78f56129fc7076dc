"""The short soaks of ``make test``: six faults of six kinds (seeded) injected from outside a 2-rank
job under ft_launcher, each recorded as the kind it was against the rank it hit, every logged loss
bit-equal to the fault-free run, one more restart resuming the data position a restored attempt
wrote; the report files and the goodput split from the run's records. Then the kinds the job does
not stop for: tier 1's storage stalled or full (the object store unreachable: tests/test_soak_store.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pretrain.observability.goodput import CAUSES
from tests.helpers import PYTHON, run

KINDS = "kill-rank,sigsegv,exception,sigstop,corrupt-kill,kill-job,sigterm,gil"
# Faults paced by steps trained (--mtti-steps), not seconds: where each lands does not depend on how
# fast the machine trains, so the run can be as short as the schedule needs (seed 3: kill-rank,
# kill-job, gil, exception, sigsegv, sigterm; pretrain soak refuses fewer steps than they may need).
# The baseline runs alongside the faulted run, which idles through every detection and restart.
STEPS = 52


def _failure_detail(work: Path, proc: subprocess.CompletedProcess[str]) -> str:
    """The soak's report and the end of its output: a string, since pytest cuts a tuple's repr to
    one line (which hid CI's failing check)."""
    return (work / "soak-report.md").read_text() + "\n" + proc.stdout[-2000:]


@pytest.mark.timeout(600)  # about 2 min on an idle 2-core machine (see the commit that set STEPS)
@pytest.mark.slow  # a job of a minute: make test runs it, make test-fast leaves it out
def test_six_random_faults_recover_bit_equal_and_are_recorded_as_injected(tmp_path: Path, corpus: Path) -> None:
    work = tmp_path / "soak"
    cmd = [PYTHON, "-m", "pretrain", "soak", "--faults", "6", "--mtti-steps", "5", "--seed", "3"]
    cmd += ["--steps", str(STEPS), "--kinds", KINDS, "--workdir", str(work), "--baseline-alongside"]
    cmd += ["--data", str(corpus)]  # the suite's corpus: built once, in-process
    proc = run(cmd, tmp_path, timeout=540, check=False)
    report = json.loads((work / "soak-report.json").read_text())
    h = report["headline"]
    detail = _failure_detail(work, proc)
    assert h["faults_injected"] == 6 and len(h["kinds_injected"]) == 6, detail
    assert h["recovery_success_rate"] == 1.0 and h["run_completed"], detail
    assert h["losses_bit_equal"] and h["losses_compared"] >= STEPS, detail  # recomputed steps included
    assert h["record_mismatches"] == [], detail
    assert h["second_resume"]["passed"], detail
    assert proc.returncode == 0 and report["passed"], detail
    for f in report["faults"]:
        assert f["recorded_class"] == f["expected_class"] and f["recovered"] and f["detection_s"] is not None, f
        if f["fault_to_next_step_s"] is not None:  # None: it hit the last steps, the next attempt only restored
            assert 0 < f["detection_s"] <= f["fault_to_next_step_s"], f
            parts = f["breakdown_s"]  # where those seconds went: the parts add up to the whole
            assert parts["detection"] == f["detection_s"], f
            assert sum(parts.values()) == pytest.approx(f["fault_to_next_step_s"], abs=0.01), f
    g = report["goodput"]["faulted"]
    assert set(g["badput_s"]) == set(CAUSES) and 0 < g["goodput_ratio"] < report["goodput"]["baseline"]["goodput_ratio"]
    parts = g["productive_s"] + sum(g["badput_s"].values())
    assert parts == pytest.approx(g["wall_s"], abs=0.005), g  # a partition: each part rounded to the ms
    assert "recovery success     : 100%" in proc.stdout and "goodput (faulted run" in proc.stdout
    assert "fault -> next step, median s: detection | launcher_restart" in proc.stdout
    projection = report["goodput"]["planner_projection"]  # the planner's figure for the measured costs
    # 6 faults in a short run: restarts can take all of the model's time, and it clamps at 0
    inputs = projection["inputs"]
    assert 0 <= projection["projected"] <= 1 and inputs["restarts"] >= 1, projection
    assert inputs["mtbf_s"] * inputs["restarts"] == pytest.approx(g["wall_s"], rel=0.01), (projection, g)
    assert "planner's projection :" in proc.stdout
    md = (work / "soak-report.md").read_text()
    assert "Result: **PASS**" in md and md.count("| yes |") == 6
    png = (work / "soak-timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.timeout(450)  # about 2 min on an idle 2-core machine
@pytest.mark.slow  # a job of a minute: make test runs it, make test-fast leaves it out
def test_storage_faults_are_recorded_and_tier_1_comes_back_without_a_restart(tmp_path: Path, corpus: Path) -> None:
    """blocked-write (tier 1 on a FUSE mount whose writes block) and full-disk (its tmpfs filled
    from outside): the job records each with its reason, keeps training, saves tier 1 again once
    the fault is released, and stays bit-equal to the fault-free run; nothing stays mounted."""
    from pretrain.soak.storage import fuse_missing

    if (why := fuse_missing()) is not None:
        pytest.skip(f"the storage kinds cannot be injected here: {why}")
    work = tmp_path / "soak"
    cmd = [PYTHON, "-m", "pretrain", "soak", "--faults", "2", "--mtti-steps", "5", "--seed", "1", "--steps", "90"]
    cmd += ["--kinds", "blocked-write,full-disk", "--workdir", str(work), "--baseline-alongside", "--data", str(corpus)]
    proc = run(cmd, tmp_path, timeout=400, check=False)
    report = json.loads((work / "soak-report.json").read_text())
    h = report["headline"]
    detail = _failure_detail(work, proc)
    assert proc.returncode == 0 and report["passed"], detail
    assert sorted(h["kinds_injected"]) == ["blocked-write", "full-disk"] and h["recovery_success_rate"] == 1.0, detail
    assert h["losses_bit_equal"] and h["record_mismatches"] == [], detail
    for f in report["faults"]:
        assert (
            f["recorded_class"]
            == f["expected_class"]
            == {"blocked-write": "stalled", "full-disk": "disk_full"}[f["kind"]]
        ), f
        assert 0 < f["detection_s"] < f["fault_to_next_step_s"] and f["lost_steps"] == 0, f
    assert str(work) not in Path("/proc/mounts").read_text(), "the soak left its tier-1 mounts behind"
