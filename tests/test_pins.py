"""Step pins across processes, PID namespaces and lease expiry: a holder killed in the reader's own
namespace frees its step at once; a holder in another PID namespace (where its pid means nothing to
the reader) keeps the step while it renews its lease and frees it once the lease runs out after its
death; a live holder keeps its step for longer than one lease. Real holders: separate processes, one
in a PID namespace of its own (``unshare --pid``, root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO
from tiering.local.pins import held_steps

HOLD = (
    "import sys, time; from pathlib import Path; from tiering.local.pins import StepPin; "
    "pin = StepPin(Path(sys.argv[1]), 10, 'upload', ttl_s=float(sys.argv[2])); "
    "print('held', flush=True); time.sleep(600)"
)


@contextmanager
def _holder(pins: Path, ttl_s: float, own_pid_namespace: bool = False) -> Iterator[subprocess.Popen[str]]:
    cmd = [PYTHON, "-c", HOLD, str(pins), str(ttl_s)]
    if own_pid_namespace:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _held_until(pins: Path, deadline_s: float) -> float:
    """Seconds until step 10 stops being held (polling), or the deadline."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s and 10 in held_steps(pins, clock_skew_s=0.0):
        time.sleep(0.1)
    return time.monotonic() - t0


def test_a_killed_holder_in_the_same_namespace_frees_its_step_at_once(tmp_path: Path) -> None:
    pins = tmp_path / "pins"
    with _holder(pins, ttl_s=60.0) as proc:
        assert held_steps(pins) == {10}
        proc.kill()
        proc.wait()
        assert held_steps(pins, clock_skew_s=0.0) == set(), "a dead pid frees the step without waiting for the lease"
    assert list(pins.iterdir()) == [], "the dead pin is removed"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_holder_in_another_pid_namespace_is_judged_by_its_lease(tmp_path: Path) -> None:
    pins = tmp_path / "pins"
    ttl = 2.0
    with _holder(pins, ttl_s=ttl, own_pid_namespace=True) as proc:
        (pin,) = pins.iterdir()
        assert json.loads(pin.read_text())["pid"] == 1, "the holder is PID 1 of its namespace"
        time.sleep(3 * ttl)  # three leases: it is held only because it renews
        assert held_steps(pins, clock_skew_s=0.0) == {10}
        proc.kill()
        proc.wait()
        freed_after = _held_until(pins, deadline_s=10 * ttl)
    assert 0 < freed_after <= ttl + 1.0, "freed when the lease runs out, not at once and not never"
    assert list(pins.iterdir()) == []


def test_a_pin_of_an_older_version_counts_by_its_age(tmp_path: Path) -> None:
    """``step-N.holder.PID`` holding a bare pid (written before leases): held while fresh, then removed."""
    pins = tmp_path / "pins"
    pins.mkdir()
    old = pins / "step-000000010.upload.1"
    old.write_text("1")
    assert held_steps(pins) == {10}
    stale = time.time() - 3600
    os.utime(old, (stale, stale))
    assert held_steps(pins) == set() and not old.exists()
