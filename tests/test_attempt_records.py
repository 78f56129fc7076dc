"""Attempt records say what happened: a rank that reported its failure is named with its report
(NVRx's heartbeat error included); "ended without a report" only for ranks that sent none, with
the phase they died in; the job stops only for a failure that repeats itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import Dataset

from pretrain.config import Config, load_config, resolve_vocab_size
from pretrain.data.dataset import build_train_dataset
from pretrain.data.prepare import build_indexed_dataset
from pretrain.observability.runlog import append_jsonl
from pretrain.resilience.attempts import AttemptLog, record_failure
from pretrain.resilience.failures import classify
from pretrain.resilience.job_policy import failures_without_progress
from pretrain.resilience.phases import PhaseRecord, pulse_path, read_phases
from tests.helpers import TINY


class RankMonitorClientError(Exception):
    """Same name as NVRx's: classify() keys on the name (NVRx is not imported to raise it)."""


def _begin(run_dir: Path, attempt: str, restart: int = 0, world: int = 2) -> AttemptLog:
    log = AttemptLog(run_dir, enabled=True)
    log.begin(attempt, world, ["vm"] * world, {"launcher_restart_count": restart, "launcher_run_id": "r"})
    return log


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]


def test_ranks_that_reported_the_heartbeat_error_are_named_with_it(tmp_path: Path) -> None:
    _begin(tmp_path, "a1")
    error = RankMonitorClientError("RankMonitorClient could not send the heartbeat. Exception: Unexpected reply: None")
    for rank in (1, 0):
        record_failure(tmp_path, "a1", rank, classify(error))
        time.sleep(0.01)
    _begin(tmp_path, "a2", restart=1)
    failure = _records(tmp_path)[0]["failure"]
    assert failure["rank"] == 1 and failure["ranks"] == [1]
    assert "Unexpected reply: None" in failure["exception"]
    assert "without a report" not in failure["evidence"] and "reported it" in failure["evidence"]


def test_a_silent_rank_is_named_with_the_phase_it_died_in(tmp_path: Path) -> None:
    _begin(tmp_path, "a1")
    survivor, victim = PhaseRecord(tmp_path, 0), PhaseRecord(tmp_path, 1)
    for rec in (survivor, victim):
        rec.attempt = "a1"
        rec.enter("verify")
    victim.enter("load")
    survivor.mark_signal("SIGTERM")  # the launcher stopped it after rank 1 vanished
    # The next attempt's processes overwrite the records; the dead process's last one travels along.
    for rank in (0, 1):
        PhaseRecord(tmp_path, rank).enter("startup")
    _begin(tmp_path, "a2", restart=1)
    failure = _records(tmp_path)[0]["failure"]
    assert failure["ranks"] == [1] and failure["phases"] == {"1": "load"}
    assert failure["evidence"] == "ranks [1] ended without a report (killed, hung or lost) during load"


def _rank_1_silent(
    tmp_path: Path, gap_s: float, phase: str = "training", hang_timeout: float | None = 8.0
) -> list[PhaseRecord]:
    """Attempt a1 of two ranks in ``phase`` (training), its hang timeout ``hang_timeout`` (8 s;
    None: not recorded); rank 1's last pulse ``gap_s`` before rank 0's."""
    first = _begin(tmp_path, "a1")
    if hang_timeout is not None:
        first.note(hang_timeout_s=hang_timeout)
    records = [PhaseRecord(tmp_path, rank) for rank in (0, 1)]
    for rec in records:
        rec.attempt = "a1"
        rec.enter(phase)
    now = time.time()
    os.utime(records[1].path, (now - gap_s, now - gap_s))
    os.utime(records[0].path, (now, now))
    return records


def _next_attempts_diagnosis(tmp_path: Path) -> dict[str, Any]:
    """The failure attempt a2 (the next processes of both ranks) finds for a1."""
    for rank in (0, 1):
        PhaseRecord(tmp_path, rank).enter("startup")
    _begin(tmp_path, "a2", restart=1)
    return _records(tmp_path)[0]["failure"]


@pytest.mark.parametrize(
    ("phase", "gap", "hang_timeout", "hung"),
    [
        ("training", 8.0, None, True),
        # A measured step timeout finds a hang in 1-2 s, and every rank's monitor kills its blocked
        # rank at that timeout: the peers outlive the hung rank's pulse by that much only.
        ("training", 2.0, None, True),
        ("training", 2.0, 2.0, True),
        # A kill on a loaded machine: the survivor reached its next collective 1.1 s later.
        ("training", 1.1, None, False),
        # At load 19 on 2 cores a step took 3.3 s and the survivor saw the kill 2.7 s late: with the
        # 8 s step timeout in force a hang's peers would have outlived it by 8 s less a step.
        ("training", 2.7, 8.0, False),
        ("training", 6.5, 8.0, True),
        # Outside the steps a killed rank's peers may take 2 s to notice (start-up, an emergency
        # save), and a hang there waits for a timeout of minutes: 2 s is a kill.
        ("monitor", 2.0, None, False),
        ("emergency_save", 2.0, None, False),
    ],
)
def test_a_rank_whose_pulse_stopped_long_before_its_peers_is_named_as_hung(
    tmp_path: Path, phase: str, gap: float, hang_timeout: float | None, hung: bool
) -> None:
    """SIGSTOP (or a thread holding the GIL): the stopped rank's pulse ends; its peers, blocked in a
    collective, pulse on until the launcher's hang timeout stops every rank, none with a report.
    The attempt's record holds the hang timeout in force (``hang_timeout_s``) where the rank
    monitor knew it."""
    _rank_1_silent(tmp_path, gap, phase, hang_timeout)
    failure = _next_attempts_diagnosis(tmp_path)
    assert failure["classification"] == "infrastructure", failure
    if hung:
        assert failure["ranks"] == [1], failure
        assert failure["evidence"].startswith(f"ranks [1] hung: no sign of life for {gap:.1f}s"), failure["evidence"]
    else:
        assert "hung" not in failure["evidence"], failure["evidence"]


def test_a_rank_a_fatal_signal_ended_is_named_with_the_signal(tmp_path: Path) -> None:
    """A real process with the pulse on dies of SIGSEGV: the next attempt names signal 11 and where."""
    _begin(tmp_path, "a1")
    survivor = PhaseRecord(tmp_path, 0)
    survivor.attempt = "a1"
    survivor.enter("training")
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from pretrain.resilience.phases import PhaseRecord\n"
        "rec = PhaseRecord(Path(sys.argv[1]), 1)\n"
        "rec.attempt = 'a1'\n"
        "rec.enter('training')\n"
        "rec.start_pulse()\n"
        "os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    for rank in (0, 1):
        PhaseRecord(tmp_path, rank).enter("startup")
    _begin(tmp_path, "a2", restart=1)
    failure = _records(tmp_path)[0]["failure"]
    assert failure["ranks"] == [1] and failure["exit_code"] == -11, failure
    assert failure["evidence"].startswith("rank 1 was killed by signal 11 (SIGSEGV) during training at File "), failure


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        # (classification, ranks, evidence, last step) of trailing failed attempts, oldest first
        ([("infrastructure", [1], "injected SIGKILL at step 3", 2)] * 3, 3),
        (
            [
                ("infrastructure", [1], "killed during load", None),
                ("infrastructure", [1], "killed during verify", None),
            ],
            1,
        ),
        ([("user", [0], "ValueError: x", 5), ("user", [0], "ValueError: x", 5)], 2),
        (
            [("infrastructure", [0, 1], "whole group during load", None), ("infrastructure", [1], "during load", None)],
            1,
        ),
        ([], 0),
    ],
)
def test_only_the_same_failure_repeating_counts_towards_a_stop(failures: list[tuple], expected: int) -> None:
    history = [
        {
            "status": "failed",
            "restored": None,
            "last_step": last,
            "failure": {"classification": c, "ranks": r, "evidence": e},
        }
        for c, r, e, last in failures
    ]
    assert failures_without_progress(history) == expected


def _train_dataset(cfg: Config) -> Dataset:
    return build_train_dataset(cfg.data, cfg.train.seed, cfg.model.seq_length, lambda: resolve_vocab_size(cfg))


def test_a_missing_or_empty_dataset_is_a_data_failure(tmp_path: Path) -> None:
    """The dataset's error is the one DataError classify() knows (it once had its own class and was
    classified as a user error)."""
    missing = load_config(str(TINY), [f"data.prefix={tmp_path / 'nowhere'}"])
    with pytest.raises(Exception) as caught:
        build_train_dataset(
            missing.data, missing.train.seed, missing.model.seq_length, lambda: resolve_vocab_size(missing)
        )
    info = classify(caught.value)
    assert info.classification == "data" and "nowhere" in info.exception and "fix:" in info.exception

    build_indexed_dataset(iter(["tiny"]), tmp_path / "empty")
    empty = load_config(str(TINY), [f"data.prefix={tmp_path / 'empty'}"])
    with pytest.raises(Exception) as caught:
        _train_dataset(empty)
    assert classify(caught.value).classification == "data", caught.value


def test_the_pulse_is_node_local_and_the_next_process_carries_it_along(tmp_path: Path) -> None:
    """The pulse touches a file under the node-local root, never the record on shared storage (issue
    45 #14); the rank's next process on the node reads it into ``previous.last_alive``."""
    run, pulse_root = tmp_path / "run", tmp_path / "shm"
    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from pretrain.resilience.phases import PhaseRecord\n"
        "rec = PhaseRecord(Path(sys.argv[1]), 3, pulse_root=Path(sys.argv[2]))\n"
        "rec.enter('training')\n"
        "rec.start_pulse()\n"
        "time.sleep(1.5)\n"
        "print(os.getpid())\n"
        "os._exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run), str(pulse_root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    record, pulse = run / "ranks" / "rank-00003.json", pulse_path(run, 3, pulse_root)
    assert pulse.is_relative_to(pulse_root) and pulse.read_text() == proc.stdout.strip()
    assert pulse.stat().st_mtime - record.stat().st_mtime >= 1.0  # the record was written once, then left alone
    assert read_phases(run, pulse_root)[3]["last_alive"] == pulse.stat().st_mtime
    last = pulse.stat().st_mtime
    # The next process as train() runs it: its pulse starts before its first record.
    nxt = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from pretrain.resilience.phases import PhaseRecord\n"
        "rec = PhaseRecord(Path(sys.argv[1]), 3, pulse_root=Path(sys.argv[2]))\n"
        "rec.start_pulse()\n"
        "rec.enter('startup')\n"
        "print(json.dumps(rec.previous))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", nxt, str(run), str(pulse_root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    previous = json.loads(proc.stdout)
    assert previous["last_alive"] == last and previous["phase"] == "training"


@pytest.mark.parametrize("reported", [True, False])
def test_a_kill_a_loaded_peer_saw_late_is_not_a_hang(tmp_path: Path, reported: bool) -> None:
    """At load 20 on 2 cores the survivor of a SIGKILL reported the reset 4.6 s after the killed
    rank's last pulse, past half the 8 s step timeout: its report, earlier than the monitor could
    have killed a hung rank, makes it a kill. Without the report the same gap is a hang."""
    _rank_1_silent(tmp_path, gap_s=4.6)
    if reported:
        record_failure(tmp_path, "a1", 0, classify(RuntimeError("pair.cc:537] Read error: Connection reset by peer")))
    failure = _next_attempts_diagnosis(tmp_path)
    assert failure["evidence"].startswith("ranks [1] hung:") is not reported, failure


@pytest.mark.parametrize("same_process", [True, False])
def test_a_rank_the_hang_watch_killed_is_named_hung_even_when_its_peer_saw_the_kill(
    tmp_path: Path, same_process: bool
) -> None:
    """The node's hang watch killed rank 1 after 2.2 s without a pulse: its peer then saw the
    connection drop at once (a report, 1.1 s of pulse gap), which alone reads as a kill. The
    watch's ``hang_killed`` event naming that process says hung; one naming another process (an
    earlier attempt's) says nothing."""
    records = _rank_1_silent(tmp_path, gap_s=1.1)
    pid = json.loads(records[1].path.read_text())["pid"] + (0 if same_process else 1)
    append_jsonl(tmp_path / "events.jsonl", {"event": "hang_killed", "rank": 1, "pid": pid, "stale_s": 2.2})
    record_failure(tmp_path, "a1", 0, classify(RuntimeError("pair.cc:537] Read error: Connection reset by peer")))
    failure = _next_attempts_diagnosis(tmp_path)
    if same_process:
        assert failure["ranks"] == [1] and failure["evidence"].startswith("ranks [1] hung: no sign of life for 2.2s")
    else:
        assert not failure["evidence"].startswith("ranks [1] hung"), failure


@pytest.mark.parametrize("attempt", ["a1", "a0"])
def test_a_node_the_liveness_found_lost_is_named_and_its_ranks_told_from_the_ones_it_stopped(
    tmp_path: Path, attempt: str
) -> None:
    """Node n1 (rank 1) vanished; node n0's agent heard no beat for 2.1 s and killed rank 0: both
    ranks ended without a report. The diagnosis names the lost node and rank 1, not rank 0; an
    event of another attempt says nothing."""
    _rank_1_silent(tmp_path, gap_s=0.3)
    lost = {"event": "node_lost", "node": "n1", "seen_by": "n0", "silent_s": 2.1, "killed_ranks": [0], "time": 5.0}
    append_jsonl(tmp_path / "events.jsonl", {**lost, "attempt": attempt})
    failure = _next_attempts_diagnosis(tmp_path)
    if attempt == "a1":
        assert failure["ranks"] == [1] and failure["classification"] == "infrastructure", failure
        assert failure["evidence"].startswith("node n1 lost: no beat for 2.1s (seen by n0); ranks [0] stopped"), failure
    else:
        assert not failure["evidence"].startswith("node n1 lost"), failure
