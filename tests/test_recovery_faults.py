"""A second fault during recovery never wedges the job: SIGKILLs from outside the job at every
phase of a restore (start-up, rank-monitor connection, verification, peer transfer, load, the
first steps after the restore) and during an emergency save, of one rank and of the whole group.
Each run finishes within ``--max-restarts`` with losses bit-equal to an uninterrupted run, and its
attempt records name the rank that was killed and the phase it died in."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.resilience.outside_faults import Fault, PhaseKiller
from tests.helpers import (
    FT_CPU,
    REFERENCE_STEPS,
    TINY,
    events,
    metrics_by_step,
    overrides_for,
    read_jsonl,
    run,
    start_nodes,
    wait_nodes,
)

pytestmark = pytest.mark.slow

# Twenty steps of the shared reference run's forty (its LR schedule: decay over 40): a kill at 17
# restores step 10, and the ten steps after it are compared bit for bit.
STEPS = 20
COMMON = {
    "train.steps": STEPS,
    "schedule.decay_steps": REFERENCE_STEPS,
    "checkpoint.local.interval": 10,
    "checkpoint.reshardable.interval": 20,
}
HOLD = 2.0  # seconds each rank stays in a targeted phase: the outside kill lands inside it


@pytest.fixture(scope="module")
def baseline(reference_40: Path) -> dict[int, dict[str, Any]]:
    """The uninterrupted run's metrics: the session's shared 40-step reference run (tests/conftest.py)."""
    return metrics_by_step(reference_40)


def _holds(faults: list[Fault]) -> dict[str, Any]:
    spec = ",".join(sorted({f"{f.restart}:{f.phase}" for f in faults if f.sig == signal.SIGKILL}))
    return {"fault_tolerance.inject.hold_at": spec, "fault_tolerance.inject.hold_seconds": HOLD}


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]


def _launch_with_faults(job: Path, overrides: list[str], faults: list[Fault], max_restarts: int) -> None:
    killer = PhaseKiller(job / "runs" / "t", faults)
    killer.start()
    try:
        cmd = ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=max_restarts, overrides=overrides)
        run(cmd, job, timeout=420, check=True)
    finally:
        killer.stop()
        killer.join(timeout=5)
    assert killer.error is None, killer.error
    assert all(f.done for f in faults), [f for f in faults if not f.done]


def _assert_bit_exact(run_dir: Path, baseline: dict[int, dict[str, Any]], from_step: int, last: int = STEPS) -> None:
    got = metrics_by_step(run_dir)
    assert sorted(got) == list(range(1, last + 1))
    for step in range(from_step, last + 1):
        assert got[step]["loss"] == baseline[step]["loss"], f"loss differs at step {step}"
        assert got[step]["grad_norm"] == baseline[step]["grad_norm"], f"grad norm differs at step {step}"


def _recovery_numbers(run_dir: Path, faults: list[Fault]) -> list[dict[str, Any]]:
    """Per outside fault: the attempt that was hit, fault -> next first step, restored step, lost steps."""
    ev = events(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    starts = [e for e in ev if e["event"] == "start"]
    out = []
    for fault in faults:
        t = fault.done["time"]
        later = [m for m in metrics if m["time"] > t]
        nxt = later[0] if later else None
        restore = next((e for e in ev if e["event"] == "restore" and e["time"] > t), None)
        start = next((e for e in starts if e["time"] > t), None)
        out.append(
            {
                "phase": fault.phase,
                "ranks": fault.ranks,
                "restart": fault.restart,
                "fault_to_next_group_s": round(start["time"] - t, 2) if start else None,
                "fault_to_next_step_s": round(nxt["time"] - t, 2) if nxt else None,
                "restored_step": restore["step"] if restore else None,
                "attempts": len(starts),
            }
        )
    return out


def _check_records(run_dir: Path, faults: list[Fault], first_failure_rank: int | None) -> list[dict[str, Any]]:
    records = _records(run_dir)
    assert records[-1]["status"] == "succeeded", records[-1]
    assert not (run_dir / "attempts" / "STOP.json").exists(), "an intact checkpoint existed: the job must not stop"
    if first_failure_rank is not None:
        assert records[0]["failure"]["rank"] == first_failure_rank
    # The records of the attempts the faults hit, in order (every attempt after the first failed).
    hit = [r for r in records if r["status"] != "succeeded"][1 if first_failure_rank is not None else 0 :]
    kills = [f for f in faults if f.sig == signal.SIGKILL]
    assert len(hit) == len(kills), [(r["status"], r.get("failure")) for r in records]
    for fault, rec in zip(kills, hit):
        failure = rec["failure"]
        assert failure is not None, rec
        assert failure["classification"] == "infrastructure", failure
        assert failure["ranks"] == sorted(fault.ranks), (fault.phase, failure)
        assert failure["phases"] == {str(r): fault.phase for r in fault.ranks}, (fault.phase, failure)
        assert "without a report" in failure["evidence"] and fault.phase in failure["evidence"], failure
    return records


ONE_RANK = [
    Fault(1, "startup", [1]),
    Fault(2, "monitor", [0]),
    Fault(3, "verify", [1]),
    Fault(4, "load", [0]),
    Fault(5, "first_steps", [1]),
]
WHOLE_GROUP = [
    Fault(1, "startup", [0, 1]),
    Fault(2, "verify", [0, 1]),
    Fault(3, "load", [0, 1]),
    Fault(4, "first_steps", [0, 1]),
]


@pytest.mark.parametrize("faults", [ONE_RANK, WHOLE_GROUP], ids=["one-rank", "whole-group"])
def test_kills_at_every_phase_of_recovery(
    tmp_path: Path, corpus: Path, baseline: dict[int, dict[str, Any]], faults: list[Fault]
) -> None:
    """Rank 1 dies at step 17 (first attempt); then each restart is killed from outside in one phase
    of its recovery; the last restart trains to the end."""
    job = tmp_path / "job"
    faults = [Fault(f.restart, f.phase, list(f.ranks)) for f in faults]
    over = overrides_for(
        job,
        corpus,
        **COMMON,
        **_holds(faults),
        **{"fault_tolerance.inject.kill_rank": 1, "fault_tolerance.inject.kill_at_step": 17},
    )
    _launch_with_faults(job, over, faults, max_restarts=len(faults) + 1)
    run_dir = job / "runs" / "t"
    _assert_bit_exact(run_dir, baseline, 11)
    ev = events(run_dir)
    assert {e["step"] for e in ev if e["event"] == "restore"} == {10}
    assert not [e for e in ev if e["event"] == "rank_monitor_wedged"]
    records = _check_records(run_dir, faults, first_failure_rank=1)
    assert len(records) == len(faults) + 2
    print(json.dumps(_recovery_numbers(run_dir, faults)))


def test_kills_during_an_emergency_save(tmp_path: Path, corpus: Path, baseline: dict[int, dict[str, Any]]) -> None:
    """SIGTERM to the ranks (a preemption) and a SIGKILL while they publish the emergency step: of
    rank 1 in the first attempt, of the whole group in the second; both resume from the last
    interval step."""
    job = tmp_path / "job"
    faults = [
        Fault(0, "training", [0, 1], sig=signal.SIGTERM, after_step=13),
        Fault(0, "emergency_save", [1]),
        Fault(1, "training", [0, 1], sig=signal.SIGTERM, after_step=23),
        Fault(1, "emergency_save", [0, 1]),
    ]
    # All forty steps: the second SIGTERM (after step 23) must land well before the last step.
    over = overrides_for(job, corpus, **{**COMMON, "train.steps": 40}, **_holds(faults))
    _launch_with_faults(job, over, faults, max_restarts=2)
    run_dir = job / "runs" / "t"
    _assert_bit_exact(run_dir, baseline, 1, last=40)
    restores = [e["step"] for e in events(run_dir) if e["event"] == "restore"]
    assert restores == [10, 20], restores
    records = _check_records(run_dir, faults, first_failure_rank=None)
    assert [r["status"] for r in records][-1] == "succeeded"
    print(json.dumps(_recovery_numbers(run_dir, faults)))


def test_kills_during_a_peer_transfer(tmp_path: Path, corpus: Path, baseline: dict[int, dict[str, Any]]) -> None:
    """Two nodes (one rank each); node-b dies at step 17 and its disk is wiped, so its rank must
    receive step 10 from node-a's replica: the receiving rank is killed mid-transfer, then the whole
    group; the third restore completes from the replica."""
    job = tmp_path / "job"
    run_dir = job / "runs" / "t"
    wiped = job / "local-node-b"
    # Launcher restart counts differ between the two nodes: each fault hits the next attempt.
    faults = [Fault(None, "transfer", [1]), Fault(None, "transfer", [0, 1])]
    over = overrides_for(
        job,
        corpus,
        **COMMON,
        **{
            "fault_tolerance.inject.hold_at": "1:transfer,2:transfer,3:transfer",
            "fault_tolerance.inject.hold_seconds": HOLD,
            "fault_tolerance.inject.kill_node": "node-b",
            "fault_tolerance.inject.kill_at_step": 17,
            "checkpoint.replication.allow_same_domain": "false",
        },
    )
    killer = PhaseKiller(run_dir, faults)
    procs = start_nodes(job, over, max_restarts=3, nproc=1)
    try:
        # node-b's disk is lost with it: wiped as soon as the job records the kill, before the restart.
        _wait_for_injected_kill(run_dir)
        shutil.rmtree(wiped)
        killer.start()
        outs = wait_nodes(job, procs)
    finally:
        killer.stop()
        for proc in procs.values():
            proc.kill()
    for node, proc in procs.items():
        assert proc.returncode == 0, outs[node][-4000:]
    assert killer.error is None, killer.error
    _assert_bit_exact(run_dir, baseline, 11)
    ev = events(run_dir)
    restores = [e for e in ev if e["event"] == "restore"]
    assert [r["step"] for r in restores] == [10]
    assert [row["tier"] for row in restores[-1]["per_rank"]] == ["local", "peer"]
    _check_records(run_dir, faults, first_failure_rank=1)
    print(json.dumps(_recovery_numbers(run_dir, faults)))


def _wait_for_injected_kill(run_dir: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "events.jsonl"
        if path.exists() and '"fault_injected"' in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError("the injected node kill never happened")
