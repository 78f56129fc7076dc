"""A fault-injecting HTTP proxy in front of the S3 server, on the server side of the connection.

Contract: :class:`FaultProxy` listens on an address of this machine (the cluster's gateway on the
bridge) and forwards every request to the real S3 endpoint (one upstream connection per request,
``Connection: close`` both ways, ``Expect: 100-continue`` answered by the proxy). While a burst is
on (:meth:`FaultProxy.burst`), no multipart part reaches the store; in its first half every other
request passes (uploads start) and each ``UploadPart`` gets, by turns, a stall mid-part (half the
part is forwarded, the connection stalls for ``stall_s``, then both sides are reset: the store
discards the truncated part), a connection reset (RST right after the request head) or ``503
SlowDown`` (the S3 throttling error, with its XML body); in its second half every request gets
``503 SlowDown`` or, one in five, a reset.

Outside a burst, two faults of a restore's ranged GETs can be asked for: :meth:`FaultProxy.cut_bodies`
breaks the next ``n`` ranged GET responses off half-way through their body (then resets the
connection), and :meth:`FaultProxy.answer_ranges_with_200` rewrites their ``206 Partial Content``
to ``200 OK``, as a proxy or cache that does not support ranges answers.

Nothing here runs in the client: the code under test sees only what a faulty store sends.
:attr:`FaultProxy.counts` says how many of each fault were injected.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
import time
from urllib.parse import urlparse

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def _read_head(conn: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes]:
    """(head up to and including the blank line, bytes already read after it); empty head at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return b"", buf
        buf += chunk
        if len(buf) > 1 << 20:
            raise ValueError("request head over 1 MiB")
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    pairs = []
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            pairs.append((name.strip(), value.strip()))
    return lines[0], pairs


def _with_close(first: str, pairs: list[tuple[str, str]], drop: tuple[str, ...] = ()) -> bytes:
    skip = ("connection", "keep-alive", *drop)
    kept = [f"{k}: {v}" for k, v in pairs if k.lower() not in skip]
    return ("\r\n".join([first, *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed or overloaded server does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def _recv_exact(conn: socket.socket, n: int, buf: bytes) -> bytes:
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("client closed mid-body")
        buf += chunk
    return buf


class FaultProxy:
    def __init__(self, listen_host: str, upstream_url: str, stall_s: float = 3.0) -> None:
        up = urlparse(upstream_url)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self.stall_s = stall_s
        self.counts = {"passed": 0, "slowdown": 0, "reset": 0, "stall": 0, "cut": 0, "range_200": 0}
        self.requests: list[tuple[float, str, str]] = []  # (time, fault, request line)
        self._burst_until = 0.0
        self._burst_s = 0.0
        self._turn = 0
        self._cuts_left = 0
        self._ranges_200 = False
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._handle(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((listen_host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{listen_host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def burst(self, seconds: float) -> None:
        """Fault requests for the next ``seconds`` (see the module docstring)."""
        self._burst_s = seconds
        self._burst_until = time.monotonic() + seconds

    def cut_bodies(self, n: int) -> None:
        """Break the next ``n`` ranged GET responses off half-way through their body."""
        with self._lock:
            self._cuts_left = n

    def answer_ranges_with_200(self, on: bool = True) -> None:
        """Rewrite the status of ranged GET responses from 206 to 200 (the body is unchanged)."""
        self._ranges_200 = on

    def in_burst(self) -> bool:
        return time.monotonic() < self._burst_until

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _choose(self, first: str, pairs: list[tuple[str, str]]) -> str:
        now = time.monotonic()
        if now >= self._burst_until:
            ranged = first.startswith("GET") and any(k.lower() == "range" for k, _ in pairs)
            with self._lock:
                if ranged and self._cuts_left > 0:
                    self._cuts_left -= 1
                    return "cut"
            return "range_200" if ranged and self._ranges_200 else "passed"
        with self._lock:
            self._turn += 1
            turn = self._turn
        if now < self._burst_until - self._burst_s / 2:  # first half: parts fail, the rest passes
            if not (first.startswith("PUT") and "partNumber=" in first):
                return "passed"
            return "stall" if turn % 2 == 0 else ("reset" if turn % 3 == 0 else "slowdown")
        return "reset" if turn % 5 == 0 else "slowdown"  # second half: everything is throttled

    def _handle(self, conn: socket.socket) -> None:
        try:
            head, rest = _read_head(conn)
            if not head:
                return
            first, pairs = _headers(head)
            kind = self._choose(first, pairs)
            with self._lock:
                self.counts[kind] += 1
                self.requests.append((time.time(), kind, first[:160]))
            if kind == "reset":
                _reset(conn)
                return
            expects = any(k.lower() == "expect" and "100" in v for k, v in pairs)
            length = next((int(v) for k, v in pairs if k.lower() == "content-length"), 0)
            if kind == "slowdown":
                if not expects:
                    _recv_exact(conn, length, rest)  # drain: the client reads a clean 503
                self._slowdown(conn)
                return
            if expects:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = _recv_exact(conn, length, rest)
            self._forward(conn, _with_close(first, pairs, ("expect",)), body, kind)
        except (OSError, ValueError, ConnectionError):
            _reset(conn)
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _slowdown(self, conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
            + f"Content-Length: {len(SLOWDOWN_BODY)}\r\nConnection: close\r\n\r\n".encode()
            + SLOWDOWN_BODY
        )

    def _forward(self, conn: socket.socket, head: bytes, body: bytes, kind: str) -> None:
        up = socket.create_connection(self.upstream, timeout=120)
        try:
            if kind == "stall":
                up.sendall(head + body[: len(body) // 2])
                time.sleep(self.stall_s)
                _reset(up)
                _reset(conn)
                return
            up.sendall(head + body)
            resp_head, rest = _read_head(up)
            if not resp_head:
                _reset(conn)
                return
            first, pairs = _headers(resp_head)
            if kind == "range_200":
                first = first.replace(" 206 Partial Content", " 200 OK")
            conn.sendall(_with_close(first, pairs))
            if kind == "cut":
                length = next((int(v) for k, v in pairs if k.lower() == "content-length"), 0)
                conn.sendall(_recv_exact(up, length // 2, rest)[: length // 2])
                _reset(conn)
                return
            conn.sendall(rest)
            while chunk := up.recv(1 << 20):
                conn.sendall(chunk)
        finally:
            with contextlib.suppress(OSError):
                up.close()
