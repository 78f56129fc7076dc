"""A rank's link to its node's checkpoint agent: find it, start it when the node has none, ask.

:class:`AgentLink` sends one JSON frame and reads one answer on the agent's abstract socket, each
bounded by ``timeout_s``: a stopped or dead agent costs the rank that long once, never a hang.
When no agent answers, the link starts one (``python -m pretrain.checkpointing.agent``, in its own
session, its log under the tier-0 root: tmpfs, never the training's storage) and waits for it to
listen; two ranks that start one at once leave one agent (the second cannot bind the address).
A link whose agent went away says so with :class:`AgentGone`; the next request starts a new one.

Never: touches tier-1 storage (the agent does), or blocks longer than its timeouts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from pretrain.checkpointing.agent.server import AgentSpec
from pretrain.errors import AgentGone
from pretrain.resilience.standby.wire import receive, require_same_user, send

RETRIES = 3  # a reset connection is retried this often, a little later each time
START_WAIT_S = 10.0  # an agent imports tiering only: it listens within a fraction of a second


class AgentLink:
    def __init__(self, spec: AgentSpec, timeout_s: float = 2.0, start: bool = True) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.start = start
        self._sock: socket.socket | None = None
        self.started_pid: int | None = None  # the agent this link started, if any

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request and its answer; AgentGone when no agent answers in time (one is started
        first when none listens and ``start``)."""
        for retry in range(RETRIES + 1):
            try:
                answer = self._exchange(message)
                break
            except (ConnectionError, BrokenPipeError) as exc:
                # An agent that died since the last request (its socket may take a moment to go):
                # ask again on a fresh connection, a new agent started if none listens. Every
                # request is idempotent.
                if retry == RETRIES:
                    raise self._gone(exc) from exc
                time.sleep(0.1 * (retry + 1))
            except (TimeoutError, OSError, ValueError) as exc:
                raise self._gone(exc) from exc
        if answer is None:
            self.close()
            raise AgentGone(f"checkpoint agent {self.spec.name}: closed the connection")
        if "error" in answer:
            raise AgentGone(f"checkpoint agent {self.spec.name}: {answer['error']}")
        return answer

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any] | None:
        sock = self._connected()
        try:
            send(sock, message)
            answer, _ = receive(sock)
        except BaseException:
            self.close()
            raise
        return answer

    def _gone(self, exc: BaseException) -> AgentGone:
        return AgentGone(f"checkpoint agent {self.spec.name}: no answer ({exc.__class__.__name__}: {exc})")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        try:
            self._sock = self._connect()
        except OSError:
            if not self.start:
                raise AgentGone(f"checkpoint agent {self.spec.name}: none listens on this node") from None
            self._start_agent()
        assert self._sock is not None
        return self._sock

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect("\0" + self.spec.name)
            require_same_user(sock)
        except OSError:
            sock.close()
            raise
        return sock

    def _start_agent(self) -> None:
        """Start an agent in its own session and connect to it (or to the one that won the race)."""
        log_path = os.path.join(self.spec.memory_root, f"agent-{self.spec.run_id}.log")
        os.makedirs(self.spec.memory_root, mode=0o700, exist_ok=True)  # tier 0's tmpfs root
        args = ["--spec", json.dumps(asdict(self.spec)), "--log", log_path]
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretrain.checkpointing.agent", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        self.started_pid = proc.pid
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            try:
                self._sock = self._connect()
                return
            except OSError as exc:
                if proc.poll() not in (None, 0):
                    why = f"checkpoint agent failed to start (exit {proc.returncode}); see {log_path}"
                    raise AgentGone(why) from exc
                time.sleep(0.05)
        raise AgentGone(f"checkpoint agent did not listen within {START_WAIT_S:.0f}s; see {log_path}")
