"""Processes the suite started must not outlive it: every process a test starts carries the test's
id in its environment (inherited by forked writers, spawned workers and reparented orphans alike);
after each test whatever still carries it is listed and killed, and at the end of the session any
process that carries the session's id (a service a fixture forgot to stop) is listed and fails the
run. /proc/PID/environ is the environment a process was started with: pytest itself never matches.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path

SESSION_VAR = "RP_TEST_SESSION"
TEST_VAR = "RP_TEST_ID"


def session_env() -> dict[str, str]:
    """This process's environment less the current test's id: for a service the session shares (S3,
    Slurm, the shared standby), not tied to the test that happened to start it, so it is not killed
    after that test; the end-of-session check still covers it."""
    return {k: v for k, v in os.environ.items() if k != TEST_VAR}


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def carrying(var: str, value: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process started with ``var=value`` in its environment."""
    needle = f"{var}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            if needle not in env.split(b"\0"):
                continue
            state = next((ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:")), "")
            if "Z" in state.split()[1:2]:  # a zombie is gone already, only unreaped
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):  # exited while we looked, or not ours to read
            continue
        found.append((int(entry.name), cmd[:200]))
    return found


def own_resource_tracker(pid: int, cmd: str) -> bool:
    """multiprocessing's resource tracker started by this (pytest) process: a per-interpreter helper
    that lives until the interpreter exits, not something a test left behind."""
    if "multiprocessing.resource_tracker" not in cmd:
        return False
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):  # exited meanwhile
        return False
    return ppid == os.getpid()


def left_behind(var: str, value: str) -> list[tuple[int, str]]:
    """What :func:`carrying` finds, less this process's own resource tracker."""
    return [(pid, cmd) for pid, cmd in carrying(var, value) if not own_resource_tracker(pid, cmd)]


def kill_all(procs: list[tuple[int, str]]) -> None:
    for pid, _ in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
