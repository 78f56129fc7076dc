"""A TCP proxy in front of the object store that can stop answering: the soak's ``s3-unreachable`` kind.

Owns one listening socket on 127.0.0.1 and the connections through it, nothing else: when to cut
the store is ``pretrain.soak.runner``'s, what the uploader recorded is ``pretrain.soak.report``'s.
It reads no HTTP: every byte from a client goes to the upstream endpoint and back, unchanged.

* :meth:`StoreProxy.black_hole`: the store stops answering, the failure mode that wedges clients
  (not a polite refusal): new connections are accepted and then get nothing (no upstream
  connection, nothing read, nothing sent), and the connections already open stall (nothing more
  is forwarded either way; their unread bytes fill the kernel's buffers until the peers' sends
  block). Every such connection is *held*.
* :meth:`StoreProxy.answer`: the store answers again: every held connection is reset (RST, as a
  server that restarted answers a stale connection) and new connections are forwarded.
* :meth:`StoreProxy.stop`: every connection closed, the threads joined; the owner calls it in a
  ``finally``.

Two threads per forwarded connection (one per direction) and one accepting: a handful of
connections from one uploader.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ACCEPT_POLL_S = 0.1
PIECE_BYTES = 64 * 1024


def endpoint_address(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (host, port); the port defaults to the scheme's."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host[:port] endpoint")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _close(sock: socket.socket | None, reset: bool) -> None:
    """Close ``sock``; ``reset``: with RST (SO_LINGER 0), as a server that restarted answers a stale
    connection. SHUT_RD first wakes a thread blocked reading it (a plain close from another thread
    does not) without sending the peer anything."""
    if sock is None:
        return
    if reset:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


@dataclass(eq=False)
class _Conn:
    client: socket.socket
    upstream: socket.socket | None = None
    held: bool = False  # open while the store stopped answering: reset when it answers again
    released: threading.Event = field(default_factory=threading.Event)  # reset (or the proxy stopped)


class StoreProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (``http://host:port``) until told to stop answering."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._target = endpoint_address(upstream)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(ACCEPT_POLL_S)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._answering = True
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.counts = {"forwarded": 0, "held": 0, "reset": 0}
        self._spawn(self._accept_loop)

    @property
    def url(self) -> str:
        """The endpoint clients use instead of the upstream one."""
        scheme = urlsplit(self.upstream).scheme
        return f"{scheme}://127.0.0.1:{self.port}"

    # -- the fault -------------------------------------------------------------------------------
    def black_hole(self) -> int:
        """Stop answering (see the module docstring); returns how many open connections it holds."""
        with self._lock:
            self._answering = False
            for conn in self._conns:
                conn.held = True
            return len(self._conns)

    def answer(self) -> int:
        """Answer again: every held connection reset, new ones forwarded; returns how many were reset."""
        with self._lock:
            self._answering = True
            held = [c for c in self._conns if c.held]
            self._conns.difference_update(held)
        for conn in held:
            self._close(conn, reset=True)
        self._count("reset", len(held))
        return len(held)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            self._close(conn, reset=True)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    # -- connections -----------------------------------------------------------------------------
    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    @staticmethod
    def _close(conn: _Conn, reset: bool) -> None:
        _close(conn.client, reset)
        _close(conn.upstream, reset)
        conn.released.set()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed: stopping
            client.settimeout(None)
            conn = _Conn(client)
            with self._lock:
                conn.held = not self._answering
                self._conns.add(conn)
            if conn.held:  # accepted, then nothing: no upstream, nothing read, nothing sent
                self._count("held")
                continue
            self._spawn(self._open_upstream, conn)

    def _open_upstream(self, conn: _Conn) -> None:
        try:
            conn.upstream = socket.create_connection(self._target, timeout=10)
            conn.upstream.settimeout(None)
        except OSError:
            self._drop(conn)  # the real endpoint refused: so does the proxy
            return
        if conn.released.is_set():  # reset (or the proxy stopped) while it was connecting
            _close(conn.upstream, reset=True)
            return
        self._count("forwarded")
        self._spawn(self._pump, conn, conn.client, conn.upstream)
        self._pump(conn, conn.upstream, conn.client)

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket) -> None:
        """Copy ``src`` to ``dst`` until either side closes; while ``conn`` is held, copy nothing and
        wait for its reset (the bytes just read are dropped with it)."""
        while True:
            try:
                data = src.recv(PIECE_BYTES)
            except OSError:
                data = b""
            if conn.held or self._stopping.is_set():
                conn.released.wait()
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)  # half-close: the other direction may still answer
                if conn.upstream is not None and src is conn.upstream:
                    self._drop(conn)
                return
            try:
                dst.sendall(data)
            except OSError:
                self._drop(conn)
                return

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            if conn.held:
                return  # its reset belongs to answer()
            self._conns.discard(conn)
        self._close(conn, reset=False)
