"""The standby wire: one ``AF_UNIX`` ``SOCK_SEQPACKET`` connection per rank start, JSON frames,
standard streams and the client's pidfd passed as file descriptors (``SCM_RIGHTS``).

Client -> server: ``{"module", "argv", "env", "cwd"}`` with fds ``[stdin, stdout, stderr, client pidfd]``.
Server -> client: ``{"pid": N}`` once the rank is forked, then ``{"status": wait status}`` when it
ends. A connection that closes before ``pid`` means nothing was forked (the client runs the rank
itself). The address is an abstract socket name (no file to clean up); both ends check that the
other runs as the same user.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

ENV = "PRETRAIN_STANDBY"  # the server's abstract address (without the leading NUL)
# A server that outlives launchers, started by whoever runs many jobs in turn on one machine (the
# test suite): a launcher started beside it uses it instead of starting one of its own.
SHARED_ENV = "PRETRAIN_STANDBY_SHARED"
AGENT_ENV = "PRETRAIN_AGENT_PID"  # the launcher that started the client: the rank's real parent is the server
MAX_FRAME = 4 << 20  # an environment of a few MB is already absurd
STDIO_AND_PIDFD = 4
# Signals for the job (Slurm's --signal and scancel, a terminal's ^C) that reach every process of a
# step: the server ignores them, a forked rank handles them as Python does by default.
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class RankRequest:
    """What a client sent: the module it runs (``python -m MODULE``), its command line,
    environment, directory and streams."""

    module: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdio: list[int]  # the client's stdin, stdout, stderr
    client_pidfd: int  # readable once the client has exited
    placement: dict[str, Any] = field(default_factory=dict)  # the client's CPUs and memory policy (.placement)


def connect(name: str) -> socket.socket:
    """A connection to the server at ``name``; OSError if none answers or it runs as another user."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect("\0" + name)
        require_same_user(sock)
    except OSError:
        sock.close()
        raise
    return sock


def listen(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind("\0" + name)
    sock.listen(64)
    return sock


def require_same_user(sock: socket.socket) -> None:
    """Raise PermissionError unless the peer runs as this process's user (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise PermissionError(f"standby peer runs as uid {uid}, not {os.getuid()}")


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next frame and the fds that came with it; (None, []) when the peer closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_FRAME, max_fds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds
