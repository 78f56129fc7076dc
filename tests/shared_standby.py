"""One standby server per pytest process (each xdist worker), shared by every job a test starts
with :func:`tests.helpers.job_env`'s environment: its launcher uses it (``wire.SHARED_ENV``, see
``pretrain/resilience/standby/beside.py``) instead of importing torch, Megatron and NVRx into a
server of its own, about 3.4 s of CPU per job.

A rank forked by it does not carry the test's id in ``/proc/PID/environ`` (a fork keeps the
server's), so whatever the server still runs after a test is that test's leftover:
:func:`leftovers_of_tests` lists it for ``tests/leftover_guard.py``. Jobs on the network-namespace clusters
and under Slurm never see it (their environment is not ``job_env``'s; an abstract socket does not
cross network namespaces anyway), and a test that finds a job's processes by their environment
asks ``job_env`` for its own server.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import psutil

from pretrain.resilience.standby import wire
from pretrain.resilience.standby.beside import start_server
from tests import leftovers

REPO = Path(__file__).resolve().parents[1]

_server: subprocess.Popen[bytes] | None = None
_address: str | None = None


def address() -> str | None:
    """The shared server's address, started on first use (None if it could not start)."""
    global _server, _address
    if _server is not None and _server.poll() is None:
        return _address
    env = leftovers.session_env()  # it outlives the test
    # Rank programs of the tests themselves (``python -m tests.probe_restore``) run in its forks too,
    # wherever pytest was started from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    fd, _ = tempfile.mkstemp(prefix="rp-standby-", suffix=".log")  # kept for reading after a failure
    with os.fdopen(fd, "wb") as output:
        _server = start_server(env, output)
    _address = env[wire.ENV]
    return _address


def leftovers_of_tests() -> list[tuple[int, str]]:
    """(pid, command line) of every live process under the shared server: ranks (and what they
    started) of a job that should have ended."""
    if _server is None or _server.poll() is not None:
        return []
    found = []
    for proc in psutil.Process(_server.pid).children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append((proc.pid, " ".join(proc.cmdline())[:200]))
        except psutil.NoSuchProcess:
            continue
    return found


def stop() -> None:
    """End the server (it ignores the job signals: SIGKILL) and wait for it."""
    global _server, _address
    if _server is not None:
        _server.kill()
        _server.wait(10)
    _server = _address = None
