"""A userspace cable between a node and the bridge, for delay and loss on this machine's kernel.

Why: the kernel here has no ``sch_netem`` (``tc qdisc add ... netem`` answers "Specified qdisc kind
is unknown"); ``tbf`` (rate) exists and is used directly. A node created with ``link="cable"`` gets
a TAP device as its ``eth0`` and another TAP as its port on the bridge; one process per end (each in
its own network namespace) moves Ethernet frames between its TAP and a ``SOCK_SEQPACKET`` unix
socket joining the two ends. Each end applies the impairment to the frames it sends: a constant
delay (frame order kept, as netem does) and independent random loss, read from a JSON file
(``{"delay_ms": 20, "loss": 0.02}``) that the harness rewrites to change the link while it runs.

Contract: ``python -m tests.cluster.cable listen|connect TAP SOCKET CONFIG`` opens the existing
persistent TAP device ``TAP`` of the current namespace and forwards until the peer end closes.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import random
import select
import socket
import struct
import sys
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
FRAME = 65536


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


class Impairment:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.mtime = 0.0
        self.delay = 0.0
        self.loss = 0.0
        self.checked = 0.0

    def refresh(self, now: float) -> None:
        if now - self.checked < 0.1:
            return
        self.checked = now
        with contextlib.suppress(OSError, ValueError):
            mtime = self.path.stat().st_mtime
            if mtime != self.mtime:
                spec = json.loads(self.path.read_text())
                self.delay, self.loss, self.mtime = spec.get("delay_ms", 0) / 1000.0, spec.get("loss", 0.0), mtime


def forward(tap: int, sock: socket.socket, impair: Impairment) -> None:
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    rng = random.Random()
    while True:
        now = time.monotonic()
        impair.refresh(now)
        while queue and queue[0][0] <= now:
            with contextlib.suppress(BlockingIOError):  # the far end's buffer is full: tail drop
                sock.send(queue.popleft()[1])
        wait = max(0.0, queue[0][0] - now) if queue else 0.1
        ready, _, _ = select.select([tap, sock], [], [], wait)
        if tap in ready:
            with contextlib.suppress(BlockingIOError):
                while True:
                    frame = os.read(tap, FRAME)
                    if impair.loss and rng.random() < impair.loss:
                        continue
                    queue.append((time.monotonic() + impair.delay, frame))
        if sock in ready:
            with contextlib.suppress(BlockingIOError):
                while True:
                    frame = sock.recv(FRAME)
                    if not frame:
                        return
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.write(tap, frame)


def main(argv: list[str]) -> int:
    mode, tap_name, path, config = argv[0], argv[1], argv[2], Path(argv[3])
    tap = open_tap(tap_name)
    if mode == "listen":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(path)
        server.listen(1)
        Path(path + ".ready").write_text("1")
        sock, _ = server.accept()
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.setblocking(False)
    with contextlib.suppress(ConnectionError, KeyboardInterrupt):
        forward(tap, sock, Impairment(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
