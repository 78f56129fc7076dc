"""TCP reachability measured for real, run inside a node's namespace (stdlib only, run by path).

Contract:

* ``ports.py listen READY PORT...``: listens on every ``PORT`` (all addresses), writes ``READY``
  once all are bound, and accepts and closes connections until killed.
* ``ports.py connect HOST TIMEOUT PORT...``: opens one TCP connection to each port at once and prints
  one JSON object ``{port: [outcome, seconds]}``; ``outcome`` is ``connected``, ``refused`` (a
  reset), ``timeout`` (no answer within ``TIMEOUT`` s: dropped) or the error's class name.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _serve(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        conn.close()


def listen(ready: Path, ports: list[int]) -> None:
    socks = []
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(16)
        socks.append(sock)
    for sock in socks:
        threading.Thread(target=_serve, args=(sock,), daemon=True).start()
    ready.write_text("ready")
    while True:
        time.sleep(3600)


def _connect(host: str, port: int, timeout: float) -> list[object]:
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            outcome = "connected"
    except ConnectionRefusedError:
        outcome = "refused"
    except TimeoutError:
        outcome = "timeout"
    except OSError as exc:
        outcome = type(exc).__name__
    return [outcome, round(time.monotonic() - start, 3)]


def connect(host: str, timeout: float, ports: list[int]) -> dict[int, list[object]]:
    with ThreadPoolExecutor(max_workers=max(1, len(ports))) as pool:
        results = pool.map(lambda p: _connect(host, p, timeout), ports)
        return dict(zip(ports, results, strict=True))


def main(argv: list[str]) -> None:
    if argv[0] == "listen":
        listen(Path(argv[1]), [int(p) for p in argv[2:]])
    elif argv[0] == "connect":
        print(json.dumps(connect(argv[1], float(argv[2]), [int(p) for p in argv[3:]])))
    else:
        raise SystemExit(f"usage: ports.py listen READY PORT... | connect HOST TIMEOUT PORT... (got {argv[0]!r})")


if __name__ == "__main__":
    main(sys.argv[1:])
