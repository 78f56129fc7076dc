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
# How long the server waits for a connected client's request: a client stopped between connect and
# send (or any same-user process that connects and stays silent) must not hold every later start.
REQUEST_TIMEOUT_S = 5.0
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


def parse_request(message: dict[str, Any], fds: list[int]) -> RankRequest:
    """The request a client sent, its types checked (ValueError naming the field otherwise): a
    malformed frame costs that connection, never the server."""
    if len(fds) != STDIO_AND_PIDFD:
        raise ValueError(f"{len(fds)} file descriptors, not {STDIO_AND_PIDFD} (stdin, stdout, stderr, pidfd)")
    checks = {
        "module": lambda v: isinstance(v, str) and v != "",
        "argv": lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
        "env": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
        "cwd": lambda v: isinstance(v, str),
        "placement": lambda v: isinstance(v, dict),
    }
    for name, valid in checks.items():
        if not valid(message.get(name, {} if name == "placement" else None)):
            raise ValueError(f"request field {name!r} missing or of the wrong type")
    module, argv, env, cwd = message["module"], message["argv"], message["env"], message["cwd"]
    return RankRequest(module, argv, env, cwd, fds[:3], fds[3], message.get("placement", {}))


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next frame and the fds that came with it; (None, []) when the peer closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_FRAME, max_fds)
    try:
        message = json.loads(data) if data else None
        if message is not None and not isinstance(message, dict):
            raise ValueError(f"a frame of {type(message).__name__}, not an object")
    except ValueError:  # json's errors are ValueErrors: the fds must not leak with the frame
        close_all(fds)
        raise
    if message is None:
        close_all(fds)
        return None, []
    return message, fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
