"""The suite's own guard: a process a test leaves running is found by the id in its environment,
even once it is reparented to init, and killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing import resource_tracker
from pathlib import Path

from tests import leftovers
from tests.helpers import REPO


def test_an_orphan_carrying_a_test_id_is_found_and_killed() -> None:
    marker = leftovers.new_id()
    env = {**os.environ, "RP_PROBE": marker}
    # The child double-forks a sleeper and exits: the sleeper is reparented to init (an orphan).
    code = "import os,time\nif os.fork()==0:\n    time.sleep(600)\n"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    found = leftovers.carrying("RP_PROBE", marker)
    assert len(found) == 1 and os.getppid() != found[0][0], found
    leftovers.kill_all(found)
    deadline = time.monotonic() + 10
    while leftovers.carrying("RP_PROBE", marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers.carrying("RP_PROBE", marker) == []


def test_this_process_s_resource_tracker_is_spared_and_a_child_it_started_is_not() -> None:
    """multiprocessing's tracker lives as long as the interpreter that started it (pytest here):
    killing it after a test would only make the next test start another."""
    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker._pid  # noqa: SLF001 - the tracker's pid is not public
    assert tracker is not None
    cmd, deadline = "", time.monotonic() + 10
    while not cmd and time.monotonic() < deadline:  # empty until the forked child has exec'd
        cmd = Path(f"/proc/{tracker}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        time.sleep(0.01)
    assert leftovers.own_resource_tracker(tracker, cmd), cmd
    marker = leftovers.new_id()
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RP_PROBE": marker}
    )
    try:
        assert [pid for pid, _ in leftovers.left_behind("RP_PROBE", marker)] == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()


SUITE = """
import os, subprocess, sys

def test_starts_a_service_and_never_stops_it():
    if os.environ.get("RP_PROBE_LEAK"):
        env = {k: v for k, v in os.environ.items() if k != "RP_TEST_ID"}  # a session service
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # rp-probe-service"], env=env)

def test_other():
    pass
"""


def _run_two_workers(tmp_path: Path, leak: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.leftover_guard"]\n')
    (tmp_path / "test_probe.py").write_text(SUITE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RP_PROBE_LEAK": "1" if leak else ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_with_two_xdist_workers_a_service_left_running_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    (tmp_path / "clean").mkdir()
    (tmp_path / "leak").mkdir()
    clean = _run_two_workers(tmp_path / "clean", leak=False)
    assert clean.returncode == 0, clean.stdout[-2000:]  # the workers themselves are not leftovers
    leaked = _run_two_workers(tmp_path / "leak", leak=True)
    assert leaked.returncode == 1, leaked.stdout[-2000:]
    assert "processes the suite started were still running" in leaked.stdout and "rp-probe-service" in leaked.stdout
    survivors = subprocess.run(["pgrep", "-f", "rp-probe-service"], capture_output=True, text=True).stdout.split()
    assert survivors == [], survivors
