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
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pretrain.checkpointing.agent.server import AgentSpec
from pretrain.config import CheckpointConfig, RunConfig
from pretrain.errors import AgentGone
from pretrain.observability.runlog import run_dir
from pretrain.resilience.hang_watch import AUTO, HangSetting
from pretrain.resilience.node_liveness import advertised_host
from pretrain.resilience.standby.wire import receive, require_same_user, send
from tiering.collective import Collective
from tiering.errors import UnsafeDirectory
from tiering.system.private_dir import private_dir

log = logging.getLogger(__name__)

RETRIES = 3  # a reset connection is retried this often, a little later each time
START_WAIT_S = 10.0  # an agent imports tiering only: it listens within a fraction of a second


def spec_for(run: RunConfig, ck: CheckpointConfig, hang_watch_s: HangSetting) -> AgentSpec:
    """The agent of ``run`` on this node (absolute paths: it outlives the rank's cwd);
    ``hang_watch_s``: ``fault_tolerance.hang_watch_s``."""
    return AgentSpec(
        run_id=run.id,
        memory_root=os.path.abspath(ck.memory.dir),
        local_root=os.path.abspath(ck.local.dir),
        slots=ck.memory.slots,
        keep=ck.local.keep,
        status_dir=os.path.abspath(run_dir(run.dir, run.id)),
        idle_exit_s=ck.agent.idle_exit_s,
        hash_threads=ck.integrity.hash_threads,
        hang_watch_s=hang_watch_s,
    )


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
        except PermissionError as exc:  # the address is another user's: no agent of ours can bind it
            raise AgentGone(f"checkpoint agent {self.spec.name}: {exc}; fix: find who holds it") from exc
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
        try:
            run_folder = private_dir(Path(self.spec.memory_root) / self.spec.run_id)  # tier 0's: 0700, ours
        except UnsafeDirectory as exc:
            raise AgentGone(f"checkpoint agent not started: {exc}") from exc
        log_path = str(run_folder / "agent.log")
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
            except PermissionError as exc:
                raise AgentGone(f"checkpoint agent {self.spec.name}: {exc}; fix: find who holds it") from exc
            except OSError as exc:
                if proc.poll() is not None and proc.returncode != 0:
                    why = f"checkpoint agent failed to start (exit {proc.returncode}); see {log_path}"
                    raise AgentGone(why) from exc
                time.sleep(0.05)
        raise AgentGone(f"checkpoint agent did not listen within {START_WAIT_S:.0f}s; see {log_path}")


def keep_agent_watching(
    run: RunConfig, ck: CheckpointConfig, hang_watch_s: HangSetting, always: bool = False
) -> AgentLink | None:
    """With ``fault_tolerance.hang_watch_s`` (or ``always``: the node liveness needs the agent):
    make sure the node's agent runs (it watches every rank of the run on the node) and keep a
    connection open for this process's life, so that the agent stays while a rank lives. None when
    the watch is off; a failure to start it is one warning (NVRx's timeouts still find hangs),
    never a failed rank."""
    if not always and hang_watch_s != AUTO and hang_watch_s <= 0:
        return None
    link = AgentLink(spec_for(run, ck, hang_watch_s), ck.agent.timeout_s)
    try:
        link.request({"op": "hello"})
    except AgentGone as exc:
        log.warning("%s; hangs are found by NVRx's section timeouts alone", exc)
        return None
    return link


def introduce_nodes(
    link: AgentLink | None, coll: Collective, node: str, attempt: str, key_file: Path, lost_after_s: float
) -> bool:
    """Collective (every rank, once per attempt, after its restore): every rank's node and the
    address its node's agent hears beats on, gathered; this rank's agent is told the attempt's
    nodes and this rank's process, and from then on finds a lost node in ``lost_after_s``
    (:mod:`pretrain.resilience.node_liveness`). False, with one warning, where it cannot (no agent,
    no route to ``MASTER_ADDR``, the agent refused the key): NVRx's timeouts find lost nodes."""
    port: int | None = None
    why = "no checkpoint agent"
    if link is not None:
        try:
            port = int(link.request({"op": "liveness"})["port"])
        except AgentGone as exc:
            why = str(exc)
    host = advertised_host() if port is not None else None
    if port is not None and host is None:
        why = "no route to MASTER_ADDR"
    rows = coll.all_gather((node, host, port))
    if len({n for n, _, _ in rows}) < 2:
        return False  # one node: nothing to watch
    if link is None or host is None or port is None:
        log.warning("lost nodes are found by NVRx's timeouts only: %s; fix: see the agent's log", why)
        return False
    peers = {n: (h, p) for n, h, p in rows if h is not None and p is not None}
    message = {
        "op": "peers",
        "attempt": attempt,
        "node": node,
        "peers": peers,
        "key_file": str(key_file),
        "lost_after_s": lost_after_s,
        "rank": coll.rank,
        "pid": os.getpid(),
    }
    try:
        link.request(message)
    except AgentGone as exc:
        log.warning("lost nodes are found by NVRx's timeouts only: %s", exc)
        return False
    return True
