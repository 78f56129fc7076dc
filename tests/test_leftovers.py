"""The suite's own guard: a process a test leaves running is found by the id in its environment,
even once it is reparented to init, and killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests import leftovers


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
