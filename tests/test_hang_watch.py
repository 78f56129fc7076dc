"""The hang watch: a training rank that stopped pulsing while its peers pulse is killed from outside.

In one process: the rule at its boundaries (just under and just over the limit, no fresh peer),
and the watch on real pulse files, real phase records and a real process (killed only when it is
the process that pulsed and it is training). End to end: a 2-rank job under ft_launcher whose rank
1 is SIGSTOPped from outside at step 25, before NVRx has measured a step timeout (it would wait
60 s): the agent kills it, the launcher restarts the group within seconds, the attempt record names
rank 1 hung, and the run is bit-equal to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.resilience.hang_watch import FRESH_S, HangWatch, hung
from pretrain.resilience.outside_faults import Fault, PhaseKiller
from tests.helpers import FT_CPU, TINY, agents_serving, events, metrics_by_step, overrides_for, read_jsonl, run


@pytest.mark.parametrize(
    ("pulses", "expected"),
    [
        ({0: 100.0, 1: 97.1}, [1]),  # 2.9 s silent, a fresh peer: hung
        ({0: 100.0, 1: 97.3}, []),  # 2.7 s: under the limit
        ({0: 100.0 - FRESH_S - 0.1, 1: 90.0}, []),  # no peer fresh: a paused node, not a hang
        ({0: 100.0, 1: 99.9, 2: 96.0, 3: 95.0}, [2, 3]),
        ({0: 95.0}, []),  # one rank on the node: NVRx's timeouts judge
    ],
)
def test_a_rank_is_hung_when_silent_past_the_limit_while_a_peer_pulses(
    pulses: dict[int, float], expected: list[int]
) -> None:
    assert hung(pulses, now=100.0, threshold_s=2.8) == expected


def _pulse(folder: Path, rank: int, pid: int, age_s: float) -> None:
    path = folder / f"rank-{rank:05d}.pulse"
    path.write_text(str(pid))
    t = time.time() - age_s
    os.utime(path, (t, t))


def _phase(run: Path, rank: int, pid: int, phase: str) -> None:
    (run / "ranks").mkdir(parents=True, exist_ok=True)
    (run / "ranks" / f"rank-{rank:05d}.json").write_text(json.dumps({"phase": phase, "pid": pid, "rank": rank}))


@pytest.mark.parametrize(
    ("phase", "record_pid_matches", "killed"),
    [("training", True, True), ("restore", True, False), ("training", False, False)],
)
def test_the_watch_kills_a_silent_training_rank_and_records_it(
    tmp_path: Path, phase: str, record_pid_matches: bool, killed: bool
) -> None:
    run = tmp_path / "runs" / "t"
    watch = HangWatch(run, threshold_s=2.0, pulse_root=tmp_path / "pulse")
    watch.folder.mkdir(parents=True)
    silent = subprocess.Popen(["sleep", "60"])
    try:
        _pulse(watch.folder, 0, os.getpid(), age_s=0.1)  # this test process pulses as rank 0
        _pulse(watch.folder, 1, silent.pid, age_s=3.0)
        _phase(run, 0, os.getpid(), "training")
        _phase(run, 1, silent.pid if record_pid_matches else silent.pid + 1, phase)
        assert watch.scan() == ([1] if killed else [])
        if killed:
            assert silent.wait(timeout=5) == -signal.SIGKILL
            [event] = read_jsonl(run / "events.jsonl")
            assert event["event"] == "hang_killed" and event["rank"] == 1 and event["stale_s"] >= 3.0
            assert watch.scan() == []  # once
        else:
            assert silent.poll() is None and not (run / "events.jsonl").exists()
    finally:
        silent.kill()
        silent.wait()


@pytest.mark.slow
def test_a_stopped_rank_is_killed_by_the_agent_and_the_group_restarts_in_seconds(
    tmp_path: Path, corpus: Path, reference_40: Path
) -> None:
    """ft-cpu.yaml as shipped: its step timeout is 60 s until 50 steps are measured, so without
    the watch this SIGSTOP at step 25 would wait a minute."""
    job = tmp_path / "job"
    fault = Fault(restart=0, phase="training", ranks=[1], sig=signal.SIGSTOP, after_step=25)
    killer = PhaseKiller(job / "runs" / "t", [fault])
    killer.start()
    settings = {
        "train.steps": 40,
        "checkpoint.local.interval": 5,
        "checkpoint.reshardable.interval": 100,
        "fault_tolerance.hang_watch_s": 2.0,
    }
    try:
        cmd = ft_launcher_command(
            TINY, nproc=2, ft_config=FT_CPU, max_restarts=2, overrides=overrides_for(job, corpus, **settings)
        )
        run(cmd, job, timeout=300, check=True)
    finally:
        killer.stop()
        killer.join(timeout=5)
    assert killer.error is None and fault.done, killer.error
    rundir = job / "runs" / "t"
    deadline = time.monotonic() + 30
    while agents_serving(rundir.resolve()) and time.monotonic() < deadline:  # told the run is done
        time.sleep(0.1)
    assert not agents_serving(rundir.resolve()), "the agent exits once the run ended"
    [kill] = [e for e in events(rundir) if e["event"] == "hang_killed"]
    assert kill["rank"] == 1
    stopped_at = fault.done["time"]
    rows = read_jsonl(rundir / "metrics.jsonl")
    attempts = sorted({r["attempt"] for r in rows})
    assert len(attempts) == 2, "one restart"
    resumed = min(r["time"] for r in rows if r["attempt"] == attempts[1])
    print(f"SIGSTOP -> killed {kill['time'] - stopped_at:.1f}s, -> next step {resumed - stopped_at:.1f}s")
    assert kill["time"] - stopped_at < 2.0 + 2.0, "the watch found the stopped rank within its limit and a scan"
    assert resumed - stopped_at < 15.0, "the group restarted in seconds, not after NVRx's 60 s timeout"
    record = json.loads(sorted((rundir / "attempts").glob("attempt-*.json"))[0].read_text())
    assert record["failure"]["ranks"] == [1] and "hung" in record["failure"]["evidence"], record["failure"]
    got, want = metrics_by_step(rundir), metrics_by_step(reference_40)
    assert sorted(got) == list(range(1, 41))
    assert all(got[s]["loss"] == want[s]["loss"] for s in range(1, 41))


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_pulse_file_of_another_user_never_gets_a_rank_killed(tmp_path: Path) -> None:
    """Another user who could write a stale pulse naming one of our ranks' pids would have the
    watch kill it: only this user's regular files count."""
    run = tmp_path / "runs" / "t"
    watch = HangWatch(run, threshold_s=2.0, pulse_root=tmp_path / "pulse")
    watch.folder.mkdir(parents=True)
    victim = subprocess.Popen(["sleep", "60"])
    try:
        _pulse(watch.folder, 0, os.getpid(), age_s=0.1)
        _pulse(watch.folder, 1, victim.pid, age_s=5.0)
        os.chown(watch.folder / "rank-00001.pulse", 4242, 4242)
        _phase(run, 0, os.getpid(), "training")
        _phase(run, 1, victim.pid, "training")
        assert watch.scan() == [] and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
