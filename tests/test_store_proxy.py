"""The soak's store proxy with real sockets, in-process: it forwards bytes both ways unchanged; black-holed,
it accepts a connection and answers nothing, and stalls the connections already open; answering
again, it resets every held connection and forwards new ones. And the timeouts of ``checkpoint.s3``
bound how long a store that stopped answering holds the uploader's S3 client."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pretrain.checkpointing.tiering_config import remote_tier
from pretrain.config import load_config
from pretrain.soak.store_proxy import StoreProxy, endpoint_address
from tests.helpers import TINY
from tiering.errors import ObjectStoreError

NO_ANSWER_S = 1.0  # how long a held request is watched for an answer that must not come


class _Upstream(BaseHTTPRequestHandler):
    """Answers every request with its method, path and body digest; keeps connections alive."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(f"{self.command} {self.path}")
        out = f"{self.command} {self.path} {len(body)} {hashlib.sha256(body).hexdigest()}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def upstream() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Handler", (_Upstream,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(upstream: tuple[str, list[str]]) -> Iterator[StoreProxy]:
    p = StoreProxy(upstream[0])
    try:
        yield p
    finally:
        p.stop()


def _connect(proxy: StoreProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.settimeout(5)
    return sock


def _request(sock: socket.socket, method: str, path: str, body: bytes = b"") -> None:
    head = f"{method} {path} HTTP/1.1\r\nHost: store\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    sock.sendall(head + body)


def _response(sock: socket.socket) -> bytes:
    """One response's body (Content-Length framed)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    while len(body) < length:
        body += sock.recv(65536)
    return body


def test_the_proxy_forwards_requests_and_answers_unchanged_on_one_connection(
    proxy: StoreProxy, upstream: tuple[str, list[str]]
) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: many pieces each way
    with _connect(proxy) as sock:
        _request(sock, "PUT", "/bucket/key", body)
        assert _response(sock) == f"PUT /bucket/key {len(body)} {hashlib.sha256(body).hexdigest()}".encode()
        _request(sock, "GET", "/bucket/key")  # the same connection, kept alive through the proxy
        assert _response(sock).startswith(b"GET /bucket/key 0 ")
    assert upstream[1] == ["PUT /bucket/key", "GET /bucket/key"] and proxy.counts["forwarded"] == 1
    assert proxy.url == f"http://127.0.0.1:{proxy.port}"


def test_a_black_holed_store_accepts_connections_and_answers_nothing_on_new_or_open_ones(
    proxy: StoreProxy, upstream: tuple[str, list[str]]
) -> None:
    opened = _connect(proxy)
    _request(opened, "GET", "/before")
    assert _response(opened).startswith(b"GET /before")
    assert proxy.black_hole() == 1  # the open connection is held
    fresh = _connect(proxy)  # the connection is accepted: a store that hangs, not one that refuses
    for sock in (opened, fresh):
        _request(sock, "GET", "/during")
        sock.settimeout(NO_ANSWER_S)
        with pytest.raises(TimeoutError):
            sock.recv(1)
    assert upstream[1] == ["GET /before"], "a request reached the store while it was black-holed"
    # a held connection takes no more bytes: sends block once the kernel's buffers are full
    opened.setblocking(False)
    sent = 0
    with pytest.raises(BlockingIOError):
        for _ in range(4096):
            sent += opened.send(b"x" * 65536)
    assert sent < 64 * 1024 * 1024
    opened.close()
    fresh.close()


def test_answering_again_resets_the_held_connections_and_forwards_new_ones(
    proxy: StoreProxy, upstream: tuple[str, list[str]]
) -> None:
    opened = _connect(proxy)
    _request(opened, "GET", "/before")
    _response(opened)
    proxy.black_hole()
    fresh = _connect(proxy)
    _request(fresh, "GET", "/during")
    time.sleep(0.2)  # the proxy accepted it while black-holed
    assert proxy.answer() == 2
    for sock in (opened, fresh):
        with pytest.raises(ConnectionResetError):
            sock.recv(1)  # a reset, not a polite end of stream
        sock.close()
    with _connect(proxy) as again:
        _request(again, "GET", "/after")
        assert _response(again).startswith(b"GET /after")
    assert upstream[1] == ["GET /before", "GET /after"] and proxy.counts["reset"] == 2


def test_stop_closes_every_connection_and_the_listener(proxy: StoreProxy) -> None:
    held = _connect(proxy)
    proxy.black_hole()
    proxy.stop()
    with pytest.raises(ConnectionResetError):
        held.recv(1)
    held.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)


def test_an_endpoint_without_a_host_is_refused() -> None:
    assert endpoint_address("http://127.0.0.1:7480") == ("127.0.0.1", 7480)
    assert endpoint_address("https://s3.example") == ("s3.example", 443)
    with pytest.raises(ValueError, match="is not an http"):
        endpoint_address("s3://bucket")


def test_the_configured_timeouts_bound_a_request_to_a_store_that_stopped_answering(
    proxy: StoreProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.s3.read_timeout_s and max_attempts reach the uploader's S3 client: a black-holed
    store fails a listing after one try of 1 s (max_attempts counts every try, the first included),
    not after five tries of the default 60 s."""
    for key, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    cfg = load_config(
        str(TINY),
        [
            "checkpoint.s3.uri=s3://bucket/prefix",
            f"checkpoint.s3.endpoint_url={proxy.url}",
            "checkpoint.s3.connect_timeout_s=1",
            "checkpoint.s3.read_timeout_s=1",
            "checkpoint.s3.max_attempts=1",
        ],
    )
    remote = remote_tier(cfg.checkpoint.s3, cfg.run.id, cfg.fault_tolerance.inject.s3_fault, cfg.source)
    proxy.black_hole()
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreError, match="ReadTimeoutError"):
        remote.committed_steps()
    assert 0.9 < time.monotonic() - t0 < 1.9
