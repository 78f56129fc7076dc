"""A rank program for the standby tests: ``python -m tests.standby_rank ACTION [ARG]``, forwarded to
a standby server when the environment names one (as ``python -m pretrain`` is).

Actions: ``report CODE`` (print what the rank sees, exit CODE), ``signal N`` (die of signal N),
``wait-term`` (print ready, exit 0 on SIGTERM), ``child`` (start a sleeping child, print both pids,
sleep), ``orphan`` (start a sleeping child, print its pid, exit at once), ``gil`` (print its pid,
then a thread takes the GIL and never gives it back: the trainer's deliberate deadlock),
``stuck-write PATH`` (print its pid, then write PATH: on a closed gated mount the write waits in
the kernel), ``stuck-thread PATH`` (a daemon thread writes PATH; print the pid, exit 3 at once).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

from pretrain.resilience.standby.client import forward
from pretrain.resilience.standby.wire import AGENT_ENV


def _report(code: str) -> int:
    seen = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "marker": os.environ.get("STANDBY_TEST_MARKER"),
        "agent": os.environ.get(AGENT_ENV),
        "dynamo_loaded": "torch._dynamo" in sys.modules,  # what a rank's first optimizer imports
        "frozen_objects": gc.get_freeze_count(),  # the server's preloaded objects, out of the collector's way
        # Full collections before this report, the server's included (none: its imports were paused).
        "full_collections_before_fork": gc.get_stats()[2]["collections"],
    }
    print(json.dumps(seen), flush=True)
    return int(code)


def _on_term(_sig: int, _frame: FrameType | None) -> None:
    print("terminated cleanly", flush=True)
    sys.exit(0)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _write(path: str) -> None:
    with open(path, "wb", buffering=0) as fh:
        fh.write(b"x" * 4096)


def act(action: str, arg: str) -> int:
    if action == "report":
        return _report(arg)
    if action == "signal":
        os.kill(os.getpid(), int(arg))
    if action == "wait-term":
        signal.signal(signal.SIGTERM, _on_term)
        print(f"ready {os.getpid()}", flush=True)
        time.sleep(600)
    if action == "gil":
        # Deferred: it imports torch. The client must call forward() before anything heavy, as
        # python -m pretrain does, or it starts and exits (torch's teardown) many seconds late.
        from pretrain.resilience.faults import hold_gil_forever

        print(json.dumps({"rank": os.getpid()}), flush=True)
        threading.Thread(target=hold_gil_forever, daemon=True).start()
        time.sleep(600)
    if action in ("stuck-write", "stuck-thread"):
        print(json.dumps({"rank": os.getpid()}), flush=True)
        write = threading.Thread(target=_write, args=(arg,), daemon=True)
        if action == "stuck-write":
            _write(arg)
            return 0
        write.start()
        time.sleep(0.5)  # the thread is in the kernel by then
        return 3
    if action in ("child", "orphan"):
        child = _sleeper()
        print(json.dumps({"rank": os.getpid(), "child": child.pid}), flush=True)
        if action == "orphan":
            os._exit(0)
        time.sleep(600)
    return 99


if __name__ == "__main__":
    code = forward("tests.standby_rank")
    sys.exit(code if code is not None else act(*sys.argv[1:], *([""] * (3 - len(sys.argv)))))
