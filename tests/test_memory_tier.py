"""Tier 0 end to end (real gloo jobs, real tmpfs, real kills and corruption): a SIGKILL from outside
the job at a random step loses 0 or 1 steps and resumes bit-exact from memory; a flipped byte in
the newest slot falls back to the older slot, both slots bad to tier 1; a tmpfs that fills turns
tier 0 off with one warning while training and tier 1 go on; a tmpfs too small is refused at start."""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.resilience.outside_faults import Fault, PhaseKiller
from pretrain.resilience.phases import ranks_in_phase
from tests.helpers import (
    FT_CPU,
    REFERENCE_STEPS,
    TINY,
    events,
    flip_byte,
    full_tensors,
    job_env,
    metrics_by_step,
    overrides_for,
    run,
    tmpfs,
    torchrun,
    torchrun_prefix,
)
from tiering.memory.slot_store import SlotStore

pytestmark = pytest.mark.slow

STEPS = 20
# One LR schedule whatever train.steps a phase of a test stops at (as in one long run): the shared
# 40-step reference run's, whose first 20 steps are the baseline.
COMMON = {
    "train.steps": STEPS,
    "schedule.decay_steps": REFERENCE_STEPS,
    "checkpoint.local.interval": 10,
    "checkpoint.reshardable.interval": 12,
}


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs mounted for this test (root only), unmounted whatever happens."""
    with tmpfs(tmp_path / "shm", 40) as mnt:
        yield mnt


@pytest.fixture(scope="module")
def baseline(reference_40: Path) -> Path:
    """An uninterrupted run without tier 0 (the session's 40-step reference run, tests/conftest.py:
    its reshardable tier keeps step 20): what every resumed run must reproduce bit for bit."""
    return reference_40.parent.parent


def _memory(root: Path, enabled: str = "true") -> dict[str, Any]:
    return {"checkpoint.memory.enabled": enabled, "checkpoint.memory.dir": str(root)}


def _assert_bit_exact(job: Path, baseline: Path, from_step: int, final: bool = True) -> None:
    got, want = metrics_by_step(job / "runs" / "t"), metrics_by_step(baseline / "runs" / "t")
    for step in range(from_step, max(got) + 1):
        assert got[step]["loss"] == want[step]["loss"], f"loss differs at step {step}"
        assert got[step]["grad_norm"] == want[step]["grad_norm"], f"grad norm differs at step {step}"
    if final:
        rel = Path("reshard") / "t" / "steps" / f"step-{STEPS:09d}" / "model"
        a, b = full_tensors(job / rel), full_tensors(baseline / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _restores(job: Path) -> list[dict[str, Any]]:
    return [e for e in events(job / "runs" / "t") if e["event"] == "restore"]


def test_sigkill_at_a_random_step_loses_at_most_one_step_and_resumes_bit_exact_from_memory(
    tmp_path: Path, corpus: Path, baseline: Path, shm_dir: Path
) -> None:
    kill_after = random.Random().randint(3, STEPS - 6)
    job = tmp_path / "crash"
    fault = Fault(0, "training", [1], after_step=kill_after)
    killer = PhaseKiller(job / "runs" / "t", [fault])
    killer.start()
    try:
        ov = overrides_for(job, corpus, **COMMON, **_memory(shm_dir, "auto"))  # the default: room, so on
        run(ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=2, overrides=ov), job, 420, True)
    finally:
        killer.stop()
        killer.join(timeout=5)
    assert killer.error is None and fault.done, killer.error
    killed_at = fault.done["time"]
    rows = [json.loads(x) for x in (job / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    last_done = max(r["step"] for r in rows if r["time"] <= killed_at and r.get("kind", "train") == "train")
    [restore] = _restores(job)
    lost = last_done - restore["step"]
    assert restore["tier"] == "memory" and [r["tier"] for r in restore["per_rank"]] == ["memory", "memory"]
    assert lost in (0, 1), f"killed after step {last_done} (asked: {kill_after}), restored {restore['step']}"
    _assert_bit_exact(job, baseline, restore["step"] + 1)


def _slots(root: Path, rank: int) -> SlotStore:
    return SlotStore(root, "t", rank, 2)


def test_a_flipped_byte_in_a_sealed_slot_is_caught_quarantined_and_tier1_used_and_both_slots_bad_too(
    tmp_path: Path, corpus: Path, baseline: Path, shm_dir: Path
) -> None:
    """A finished run's tier 1 holds its final step, as tier 0 does: a bad slot of that step is
    caught on one rank, so every rank uses tier 1 (the newest step every rank can obtain)."""
    job = tmp_path / "job"
    torchrun(job, 2, overrides_for(job, corpus, **{**COMMON, "train.steps": 15}, **_memory(shm_dir)))
    newest = max(_slots(shm_dir, 0).views(), key=lambda v: v.step or -1)
    assert newest.step == 15
    flip_byte(_slots(shm_dir, 0).state_path(newest.index))

    torchrun(job, 2, overrides_for(job, corpus, **{**COMMON, "train.steps": 18}, **_memory(shm_dir)))
    first = _restores(job)[-1]
    assert (first["step"], first["tier"]) == (15, "local"), first
    assert [r["step"] for r in first["rejected"]] == [15] and "chunk" in first["rejected"][0]["reason"]
    assert first["rejected"][0]["reason"].startswith("rank 0: tier 0: ")
    assert (_slots(shm_dir, 0).quarantine_dir / f"slot-{newest.index}" / "REASON").is_file()
    _assert_bit_exact(job, baseline, 16, final=False)

    assert sorted(v.step or -1 for v in _slots(shm_dir, 1).views()) == [17, 18]
    for view in _slots(shm_dir, 1).views():
        flip_byte(_slots(shm_dir, 1).state_path(view.index))
    torchrun(job, 2, overrides_for(job, corpus, **COMMON, **_memory(shm_dir)))
    second = _restores(job)[-1]
    assert (second["step"], second["tier"]) == (18, "local"), second
    assert [r["reason"].split(":")[0] for r in second["rejected"]] == ["rank 1"]
    _assert_bit_exact(job, baseline, 19)


def test_a_full_tmpfs_turns_tier0_off_with_one_warning_and_training_and_tier1_go_on(
    tmp_path: Path, corpus: Path, baseline: Path, small_tmpfs: Path
) -> None:
    job = tmp_path / "full"
    holds = {"fault_tolerance.inject.hold_at": "0:first_steps", "fault_tolerance.inject.hold_seconds": 4}
    cmd = [*torchrun_prefix(2), "-m", "pretrain", "train", "--config", str(TINY)]
    for item in overrides_for(job, corpus, **COMMON, **_memory(small_tmpfs), **holds):
        cmd += ["--set", item]
    job.mkdir()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env(job))
    try:
        deadline = time.monotonic() + 240
        while ranks_in_phase(job / "runs" / "t", 0, "first_steps", [0, 1]) is None:
            assert time.monotonic() < deadline and proc.poll() is None, "the job never reached its first step"
            time.sleep(0.05)
        # Past the start-up check, before the first slot write: something else fills the tmpfs.
        subprocess.run(["dd", "if=/dev/zero", f"of={small_tmpfs / 'filler'}", "bs=1M"], capture_output=True)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    (job / "job.log").write_text(out)
    assert proc.returncode == 0, out[-3000:]
    ev = events(job / "runs" / "t")
    disabled = [e for e in ev if e["event"] == "tier_disabled"]
    assert len(disabled) == 1 and disabled[0]["tier"] == "memory" and "is full" in disabled[0]["error"]
    assert len([line for line in out.splitlines() if "tier 0 turned off" in line and "WARNING" in line]) == 1
    assert "fix:" in disabled[0]["error"]
    assert not [e for e in ev if e["event"] == "save" and e["tier"] == "memory"]
    assert [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local"] == [10, STEPS]
    _assert_bit_exact(job, baseline, 1)


def test_a_tmpfs_too_small_for_the_slots_is_refused_when_asked_for_and_turned_off_under_auto(
    tmp_path: Path, corpus: Path, baseline: Path, small_tmpfs: Path
) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={small_tmpfs / 'filler'}", "bs=1M", "count=30"], check=True)
    job = tmp_path / "refused"
    proc = torchrun(job, 2, overrides_for(job, corpus, **COMMON, **_memory(small_tmpfs)), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if f"checkpoint.memory.dir {small_tmpfs}" in line]
    assert lines, out[-3000:]
    assert "2 slots x (own" in lines[0] and "--shm-size" in lines[0] and "emptyDir" in lines[0]
    assert not (job / "runs" / "t" / "metrics.jsonl").exists(), "no step may run"
    # The default on the same node: the run trains without tier 0 and says why once, with the sizes.
    job = tmp_path / "auto"
    proc = torchrun(job, 2, overrides_for(job, corpus, **COMMON, **_memory(small_tmpfs, "auto")))
    out = proc.stdout + proc.stderr
    warned = [line for line in out.splitlines() if "tier 0 off (checkpoint.memory.enabled: auto)" in line]
    assert len(warned) == 1 and "2 slots x (own" in warned[0] and "fix:" in warned[0], out[-3000:]
    ev = events(job / "runs" / "t")
    assert [e["reason"] for e in ev if e["event"] == "tier0_off"] == [warned[0].split("auto): ", 1)[1]]
    assert not [e for e in ev if e["event"] == "save" and e["tier"] == "memory"]
    assert [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local"] == [10, STEPS]
    assert [p.name for p in small_tmpfs.rglob("*") if p.is_file()] == ["filler"], "tier 0 wrote nothing"
    _assert_bit_exact(job, baseline, 1)


def test_an_in_process_restart_restores_the_newest_step_from_tier0(
    tmp_path: Path, corpus: Path, baseline: Path, shm_dir: Path
) -> None:
    """Tier 0 is the in-process restart's host copy: the step before the exception, no disk read."""
    over = {
        **COMMON,
        **_memory(shm_dir),
        "fault_tolerance.inprocess.enabled": "true",
        "fault_tolerance.inject.raise_rank": 1,
        "fault_tolerance.inject.raise_at_step": 17,
    }
    torchrun(tmp_path, 2, overrides_for(tmp_path, corpus, **over))
    ev = events(tmp_path / "runs" / "t")
    starts = [e for e in ev if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["pids"] == starts[1]["pids"], "the same processes must go on"
    [restore] = _restores(tmp_path)
    assert (restore["step"], restore["tier"]) == (16, "memory"), restore  # tier 1 holds step 10 only
    _assert_bit_exact(tmp_path, baseline, 17)
