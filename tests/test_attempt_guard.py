"""How an attempt that fails is recorded, in-process: a real attempt record, real failure reports,
a real preemption watch given a real SIGTERM. Told to leave, a rank whose way out fails on storage
or a lost peer is still preempted (the soak's SIGTERM to the launcher); a programming error on the
way out stays the user's error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pretrain.errors import PreemptedError
from pretrain.observability.metrics import TrainingMetrics
from pretrain.resilience.attempt_guard import AttemptContext, fail_attempt
from pretrain.resilience.attempts import AttemptLog, attempts_dir
from pretrain.resilience.preemption import PreemptionWatch
from tiering.errors import PublishError


@pytest.fixture
def preempted_ctx(tmp_path: Path) -> Iterator[AttemptContext]:
    """Rank 0 of an attempt whose rank got SIGTERM (its watch installed, the signal delivered)."""
    records = AttemptLog(tmp_path, enabled=True)
    records.begin("attempt-00-abcdef12", 2, ["h0", "h1"], {})
    watch = PreemptionWatch([signal.SIGTERM], timeout_s=600.0, on_deadline=lambda message: None)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not watch.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.requested
        yield AttemptContext("attempt-00-abcdef12", 0, tmp_path, records, watch, TrainingMetrics("t"), None)
    finally:
        watch.finished()
        watch.uninstall()


def _outcome(run_dir: Path) -> tuple[dict[str, object], dict[str, object]]:
    (record,) = [json.loads(p.read_text()) for p in attempts_dir(run_dir).glob("attempt-*.json")]
    (report,) = [json.loads(p.read_text()) for p in (attempts_dir(run_dir) / "failures").glob("*.json")]
    return record, report


def test_a_storage_failure_on_the_way_out_of_a_preemption_is_recorded_as_the_preemption(
    preempted_ctx: AttemptContext,
) -> None:
    fail_attempt(preempted_ctx, PublishError("step 40: rank 1 could not commit its part: manifest.json missing"))
    record, report = _outcome(preempted_ctx.run_dir)
    assert record["status"] == "preempted" and record["emergency_published"] is False, record
    assert "could not commit its part" in str(record["emergency"]), record
    assert report["classification"] == "preempted", report


def test_a_lost_peer_after_the_launchers_sigterm_stays_a_lost_peer(preempted_ctx: AttemptContext) -> None:
    """The launcher stopping a group whose rank 1 was killed sends rank 0 SIGTERM too: rank 0's
    lost-peer error is not a preemption (the next attempt's diagnosis names rank 1)."""
    fail_attempt(preempted_ctx, RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    record, report = _outcome(preempted_ctx.run_dir)
    assert record["status"] == "failed" and report["classification"] == "infrastructure", (record, report)
    assert report["peer_lost"] is True, report


def test_a_programming_error_on_the_way_out_of_a_preemption_stays_a_user_error(
    preempted_ctx: AttemptContext,
) -> None:
    fail_attempt(preempted_ctx, TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"))
    record, report = _outcome(preempted_ctx.run_dir)
    assert report["classification"] == "user" and record["status"] == "failed", (record, report)


_DEADLINE_RACE = """
import os, signal, sys, time
from pathlib import Path
from pretrain.errors import PreemptedError
from pretrain.observability.metrics import TrainingMetrics
from pretrain.resilience.attempt_guard import AttemptContext, fail_attempt
from pretrain.resilience.attempts import AttemptLog, record_failure
from pretrain.resilience.failures import classify
from pretrain.resilience.preemption import PreemptionWatch

run_dir = Path(sys.argv[1])
records = AttemptLog(run_dir, enabled=True)
records.begin("attempt-00-abcdef12", 2, ["h0", "h1"], {})

def deadline_passed(message):  # as the attempt guard's, then slow: the main thread runs meanwhile
    record_failure(run_dir, "attempt-00-abcdef12", 0, classify(PreemptedError(message)))
    records.end("preempted", None, emergency=message)
    time.sleep(1.0)

watch = PreemptionWatch([signal.SIGTERM], timeout_s=0.05, on_deadline=deadline_passed)
ctx = AttemptContext("attempt-00-abcdef12", 0, run_dir, records, watch, TrainingMetrics("t"), None)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.3)  # past the deadline: the watchdog is recording the preemption
# the peer left at its own deadline: this rank's collective fails on the lost peer
fail_attempt(ctx, RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
print("the main thread recorded its failure after the deadline", flush=True)
time.sleep(5)
"""


def test_past_the_deadline_the_watchdogs_preemption_record_stands(tmp_path: Path) -> None:
    """A CI run recorded a preemption as a failure: rank 0's watchdog recorded it at the deadline,
    then its main thread, failing on the peer that had left at its own deadline, overwrote it."""
    proc = subprocess.run(
        [sys.executable, "-c", _DEADLINE_RACE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == PreemptedError.EXIT_CODE, proc.stdout + proc.stderr
    assert "after the deadline" not in proc.stdout, proc.stdout
    record, report = _outcome(tmp_path)
    assert record["status"] == "preempted" and "did not finish" in str(record["emergency"]), record
    assert report["classification"] == "preempted", report
