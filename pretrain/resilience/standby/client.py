"""The rank's stand-in towards the launcher, when a standby server is beside it.

``python -m pretrain`` and the ``pretrain`` console script (``pretrain.cli.main``) call
:func:`forward` before importing anything heavy. If the environment
names a server and it answers, this process hands over its command line, environment, directory
and standard streams, and from then on stands for the forked rank: signals it receives go to the
rank, and it ends as the rank ended (same exit code, or killed by the same signal), so the
launcher's view (exit codes, ``killpg`` of its worker, restarts) is unchanged. If it is killed
outright, the rank kills itself (it watches this process's pidfd).

No server, or one that does not answer: :func:`forward` returns None and the caller runs the rank
itself. Once a rank was forked there is no going back: a lost server means an unknown exit status.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
from types import FrameType

from pretrain.resilience.standby import placement, wire

# Everything a launcher or a user may send a rank and expect it to handle (SIGKILL and SIGSTOP
# cannot be caught: the rank dies with the client, and a stopped client stops nothing).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)


class Forwarder:
    """Signals this process receives, delivered to the rank once its pid is known."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        if self.pid is None:
            self.pending.append(sig)
        else:
            _send(self.pid, sig)

    def attach(self, pid: int) -> None:
        self.pid = pid
        for sig in self.pending:
            _send(pid, sig)
        self.pending.clear()

    def release(self) -> None:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def _send(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the rank ended already; its status is on its way
        os.kill(pid, sig)


def _request(sock: socket.socket, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != wire.ENV}  # the rank's own children run themselves
    env[wire.AGENT_ENV] = str(os.getppid())
    pidfd = os.pidfd_open(os.getpid())
    try:
        message = {"module": module, "argv": sys.argv, "env": env, "cwd": os.getcwd(), "placement": placement.read()}
        wire.send(sock, message, [0, 1, 2, pidfd])
    finally:
        os.close(pidfd)


def forward(module: str) -> int | None:
    """Run ``python -m module`` (this process's own program) in the standby server, if one is named
    and answers: the rank's exit code (a fatal signal is re-raised here). None: run it here."""
    name = os.environ.get(wire.ENV)
    if not name:
        return None
    try:
        sock = wire.connect(name)
    except OSError as exc:
        print(f"standby: server {name} does not answer ({exc}); this rank imports everything itself", file=sys.stderr)
        return None
    forwarder = Forwarder()
    with sock:
        try:
            _request(sock, module)
            started, _ = wire.receive(sock)
        except OSError:  # reset: the server went away (or refused) before forking
            started = None
        if started is None:  # nothing runs anywhere yet
            forwarder.release()
            print(f"standby: server {name} closed without starting the rank; running it here", file=sys.stderr)
            return None
        forwarder.attach(int(started["pid"]))
        try:
            ended, _ = wire.receive(sock)
        except OSError:
            ended = None
    if ended is None:
        return _outlive_lost_server(int(started["pid"]))
    return mirror(int(ended["status"]))


def _outlive_lost_server(pid: int) -> int:
    """The server died (with its launcher) while the rank runs: wait for the rank to end."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None
    if pidfd is not None:
        select.select([pidfd], [], [])
        os.close(pidfd)
    print(f"standby: the server was lost; rank process {pid} ended with an unknown status", file=sys.stderr)
    return 1


def mirror(status: int) -> int:
    """End as the rank ended: killed by its signal (re-raised here), or its exit code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal this process cannot die of (SIGCHLD, say): the shell's convention
    return os.waitstatus_to_exitcode(status)
