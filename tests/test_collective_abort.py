"""The in-process abort shuts down exactly the connections an incarnation opened (real sockets)."""

from __future__ import annotations

import socket

from pretrain.resilience.collective_abort import IncarnationConnections


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2])
    accepted, _ = listener.accept()
    return client, accepted


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _alive(a: socket.socket, b: socket.socket) -> bool:
    a.sendall(b"x")
    return b.recv(1) == b"x"


def test_only_connections_opened_since_the_mark_are_shut_down() -> None:
    collectives, service = _listener(), _listener()
    old = _pair(collectives)  # e.g. the rendezvous store: made before the incarnation
    connections = IncarnationConnections(keep_ports=[service.getsockname()[1]])
    connections.mark()
    new = _pair(collectives)  # a process group's connection
    kept = _pair(service)  # the exporter / object store: outlives the incarnation
    try:
        assert connections.shut_down() == 2  # both ends of the new connection live in this process
        client, accepted = new
        assert client.recv(1) == b"" and accepted.recv(1) == b"", "a blocked reader sees the connection end"
        assert _alive(*old) and _alive(*reversed(old)) and _alive(*kept)
        assert client.fileno() >= 0, "the descriptor is left to its owner to close"
        assert connections.shut_down() == 0, "connections already shut are not counted again"
    finally:
        for sock in (*old, *new, *kept, collectives, service):
            sock.close()
