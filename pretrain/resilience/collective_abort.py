"""Unblock gloo collectives in flight when an in-process restart aborts an incarnation.

NCCL communicators can be aborted; gloo's cannot: ``abort()``, ``shutdown()`` and
``destroy_process_group()`` on a gloo group leave a collective that is already waiting on a
peer blocked until the group's timeout. What does unblock it is its TCP connection failing,
which is what happens when a peer process dies. So the abort shuts down (``shutdown(2)``, not
``close``: the descriptors stay owned by gloo) every TCP connection this process opened during
the incarnation: the waiting collective fails at once with "connection closed", on this rank
and on every peer it was connected to.

The connections to keep are the ones made before the incarnation started (the rendezvous
stores, the launcher's) and those to services that live across incarnations: listed by port.
Linux only (``/proc``); elsewhere it does nothing and the collective timeout applies.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

_TCP_ESTABLISHED = "01"


def socket_inodes() -> dict[int, int]:
    """This process's socket descriptors: fd -> socket inode."""
    found: dict[int, int] = {}
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        return found
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / name)
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith("socket:["):
            found[int(name)] = int(target[len("socket:[") : -1])
    return found


def _established_tcp() -> dict[int, tuple[int, int]]:
    """Established TCP connections of this network namespace: inode -> (local port, remote port)."""
    connections: dict[int, tuple[int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _TCP_ESTABLISHED:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            connections[int(fields[9])] = (local_port, remote_port)
    return connections


class IncarnationConnections:
    """The TCP connections opened since :meth:`mark` (one incarnation's process groups)."""

    def __init__(self, keep_ports: Iterable[int] = ()) -> None:
        self._keep_ports = frozenset(p for p in keep_ports if p)
        self._before: frozenset[int] = frozenset()

    def mark(self) -> None:
        """Remember the sockets that exist now: they are never shut down."""
        self._before = frozenset(socket_inodes().values())

    def shut_down(self) -> int:
        """Shut down every connection opened since :meth:`mark`; returns how many."""
        tcp = _established_tcp()
        count = 0
        for fd, inode in socket_inodes().items():
            ports = tcp.get(inode)
            if inode in self._before or ports is None or self._keep_ports.intersection(ports):
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:  # closed (or reused) since it was listed
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:  # already shut
                pass
            finally:
                sock.detach()  # the descriptor stays gloo's to close
        log.info("in-process abort: shut down %d collective connection(s)", count)
        return count
