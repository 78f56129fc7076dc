"""The checkpoint agent process: one per run per node, beside the ranks, outliving them.

Owns the node's tier-1 work for one run: requests from the ranks (``persist`` a sealed tier-0 slot,
``status``) arrive on an abstract ``AF_UNIX`` socket named after the user, the run, its records
directory and the tier-0 root (:func:`address`), so two jobs on one node never share an agent;
one worker thread runs the :class:`~pretrain.checkpointing.agent.drain.SlotDrain` in request
order. The socket loop never touches storage, so a rank's status request is answered while the
worker is held by a stalled volume. The agent's status (queue, the step in progress and since
when, the newest persisted step per rank, the last error) is written to
``<run dir>/agents/<host>.json`` every 2 s and after every request it finishes, for
``pretrain status``.

Lifetime: started by the first rank of the node that finds none (:mod:`.client`), in its own
session so that a rank's death or its process group's signal never reaches it. It finishes every
request it accepted (a rank that dies mid-save loses nothing the agent holds), and exits once no
rank has been connected and nothing was queued for ``idle_exit_s``, or at once when a rank said
the run trained to its end (``finish``) and the last rank disconnected. A second agent started
for the same address finds it bound and exits at once. A killed agent leaves at most a temporary
step directory behind, never a published torn step; the next agent removes it.

With ``hang_watch_s`` (seconds, or ``auto``) the agent also watches the run's ranks on its node from outside them
(:class:`pretrain.resilience.hang_watch.HangWatch`): a rank's held GIL cannot stop that watch. In a
multi-node run the ranks introduce their attempt's nodes (``liveness``, then ``peers``) and the
agent beats to the other nodes' agents and watches theirs
(:class:`pretrain.resilience.node_liveness.NodeLiveness`): a lost node is found in seconds.

Never: imports torch or Megatron (it starts in a fraction of a second), reads a slot other than the
one a request names, or answers a peer running as another user.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpointing.agent.drain import Persist, SlotDrain
from pretrain.resilience.hang_watch import AUTO, HangSetting, HangWatch
from pretrain.resilience.node_liveness import NodeLiveness
from pretrain.resilience.standby.wire import receive, require_same_user, send
from tiering.errors import RunKeyError
from tiering.system.fsio import atomic_write_bytes
from tiering.trust.run_key import load as load_run_key

log = logging.getLogger("pretrain.agent")


def address(run_id: str, memory_root: str | Path, run_dir: str | Path) -> str:
    """The abstract socket name of the agent of ``run_id`` (records in ``run_dir``) whose slots live
    under ``memory_root``: two runs on a node never share one, even under one run id."""
    where = f"{os.path.realpath(memory_root)}\0{run_id}\0{os.path.realpath(run_dir)}"
    return f"resilient-pretrain-agent-{os.getuid()}-{hashlib.sha256(where.encode()).hexdigest()[:20]}"


@dataclass(frozen=True)
class AgentSpec:
    """Everything an agent needs, passed on its command line as JSON by the rank that starts it."""

    run_id: str
    memory_root: str
    local_root: str
    slots: int
    keep: int
    status_dir: str  # the run's records directory: <run dir>/agents/<host>.json
    idle_exit_s: float = 60.0
    hash_threads: int = 2
    hang_watch_s: HangSetting = 0.0  # > 0 or auto: watch the run's ranks on this node (status_dir is the run dir)

    @property
    def name(self) -> str:
        return address(self.run_id, self.memory_root, self.status_dir)


class Agent:
    """The socket loop and the worker of one agent (built and run by :func:`main`)."""

    def __init__(self, spec: AgentSpec, listener: socket.socket) -> None:
        self.spec = spec
        self.listener = listener
        self.drain = SlotDrain(
            Path(spec.memory_root), Path(spec.local_root), spec.run_id, spec.slots, spec.keep, spec.hash_threads
        )
        self.jobs: queue.Queue[Persist | None] = queue.Queue()
        self.lock = threading.Lock()  # the drain's progress, read by status requests
        # One status write at a time, its snapshot taken inside: the worker's write after a request
        # and the reporter's periodic one never land out of order (an older snapshot last).
        self.status_write = threading.Lock()
        self.current: tuple[Persist, float] | None = None  # the request being persisted, since when
        self.queued: list[Persist] = []
        self.last_error: str | None = None
        self.clients: set[socket.socket] = set()
        self.idle_since = time.monotonic()
        self.stopping = False
        self.finishing = False
        self.status_path = Path(spec.status_dir) / "agents" / f"{socket.gethostname()}.json"
        self.liveness: NodeLiveness | None = None  # made at the first rank's ``liveness`` request
        self.liveness_stop = threading.Event()
        self.liveness_thread: threading.Thread | None = None

    # -- worker ----------------------------------------------------------------------------------
    def work(self) -> None:
        while (job := self.jobs.get()) is not None:
            with self.lock:
                self.current = (job, time.time())
                self.queued.remove(job)
            try:
                error = self._persist(job)
            except Exception as exc:  # noqa: BLE001 - a listing or retention the volume refused: keep serving
                error = f"{type(exc).__name__}: {exc}"
                self.drain.rank_progress(job.rank).failed[job.step] = error
                log.exception("agent: rank %d step %d failed", job.rank, job.step)
            finally:
                with self.lock:
                    self.current = None
            if error is not None:
                with self.lock:
                    self.last_error = f"rank {job.rank} step {job.step}: {error}"
            self._write_status()

    def _persist(self, job: Persist) -> str | None:
        if job.rank not in self.drain.progress:
            for path in self.drain.clean_stale(job.rank):
                log.info("agent: removed the unfinished copy of an earlier agent: %s", path)
        return self.drain.persist(job)

    def report(self, every_s: float = 2.0) -> None:
        """Keep the status file fresh while the worker is held (a stall shows as it lasts); on its
        own thread, so that a stalled run directory holds neither the worker nor the socket loop."""
        while not self.stopping:
            self._write_status()
            time.sleep(every_s)

    def _write_status(self) -> None:
        with self.status_write:
            try:
                self.status_path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.status_path, (json.dumps(self.status()) + "\n").encode(), durable=False)
            except OSError as exc:
                log.warning("agent: status not written to %s: %s", self.status_path, exc.strerror or exc)

    def status(self, rank: int | None = None) -> dict[str, Any]:
        with self.lock:
            progress = dict(self.drain.progress)  # one C-level copy: the worker may add a rank meanwhile
            ranks = {r: p for r, p in progress.items() if rank is None or r == rank}
            current = self.current
            body: dict[str, Any] = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "updated": time.time(),
                "queued": [j.step for j in self.queued if rank is None or j.rank == rank],
                "current": None if current is None else {"rank": current[0].rank, "step": current[0].step},
                "current_since": None if current is None else current[1],
                "last_error": self.last_error,
                "ranks": {
                    str(r): {"persisted": list(p.persisted), "failed": {str(s): e for s, e in dict(p.failed).items()}}
                    for r, p in ranks.items()
                },
            }
        return body

    # -- requests --------------------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "persist":
            job = Persist(int(message["rank"]), int(message["slot"]), int(message["step"]))
            with self.lock:
                self.drain.set_floor(job.rank, message.get("floor"))
                self.queued.append(job)
            self.jobs.put(job)
            return {"ok": True}
        if op == "finish":  # the run's final step is persisted: exit once no rank is connected
            self.finishing = True
            return {"ok": True}
        if op == "hello":  # a rank that keeps a connection open: the agent stays while it lives
            return {"ok": True, "pid": os.getpid()}
        if op == "liveness":  # a rank of a multi-node run asks where this node's beats are heard
            return {"ok": True, "port": self._liveness().port}
        if op == "peers":  # that rank's attempt, its node and every node's beat address
            try:
                key = load_run_key(Path(message["key_file"]))
            except RunKeyError as exc:
                return {"error": str(exc)}
            self._liveness().introduce(message, key)
            return {"ok": True}
        if op == "status":
            rank = int(message["rank"])
            with self.lock:
                self.drain.set_floor(rank, message.get("floor"))
            return self.status(rank)
        return {"error": f"unknown request {op!r}"}

    def _liveness(self) -> NodeLiveness:
        with self.lock:
            if self.liveness is None:
                self.liveness = NodeLiveness(self.spec.run_id, Path(self.spec.status_dir))
                thread = threading.Thread(
                    target=self.liveness.run, args=(self.liveness_stop,), name="agent-liveness", daemon=True
                )
                thread.start()
                self.liveness_thread = thread
            return self.liveness

    def serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        while not self.stopping:
            for key, _ in sel.select(timeout=0.5):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    self._accept(sel)
                else:
                    self._serve_one(sel, sock)
            if self._idle_too_long():
                break
        self.jobs.put(None)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        conn, _ = self.listener.accept()
        try:
            require_same_user(conn)
        except PermissionError as exc:
            log.warning("agent: refused a connection: %s", exc)
            conn.close()
            return
        self.clients.add(conn)
        sel.register(conn, selectors.EVENT_READ)

    def _serve_one(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        try:
            message, _ = receive(conn)
            if message is not None:
                send(conn, self.handle(message))
                return
        except Exception as exc:  # noqa: BLE001 - one bad request costs that client, never the agent
            log.warning("agent: dropped a client after a bad request: %s", exc)
        sel.unregister(conn)
        self.clients.discard(conn)
        conn.close()
        self.idle_since = time.monotonic()

    def _idle_too_long(self) -> bool:
        with self.lock:
            busy = bool(self.clients) or self.current is not None or bool(self.queued)
        if busy:
            self.idle_since = time.monotonic()
            return False
        return self.finishing or time.monotonic() - self.idle_since > self.spec.idle_exit_s


def _log_file(path: str) -> Any:
    """The agent's log, appended to, never through a symlink (it lives in a private run folder)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "a", buffering=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.checkpointing.agent")
    parser.add_argument("--spec", required=True, help="the AgentSpec as JSON")
    parser.add_argument("--log", help="append the agent's log here (default: stderr)")
    args = parser.parse_args(argv)
    spec = AgentSpec(**json.loads(args.spec))
    os.umask(0o077)
    handler = logging.StreamHandler(_log_file(args.log) if args.log else sys.stderr)
    logging.basicConfig(level=logging.INFO, handlers=[handler], format="%(asctime)s agent[%(process)d] %(message)s")
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # the job's signals: the agent finishes what it accepted
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + spec.name)
    except OSError:
        log.info("agent: another agent serves run %s on this node; exiting", spec.run_id)
        return 0
    listener.listen(64)
    agent = Agent(spec, listener)
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "stopping", True))
    worker = threading.Thread(target=agent.work, name="agent-drain", daemon=True)
    worker.start()
    threading.Thread(target=agent.report, name="agent-status", daemon=True).start()
    watching = threading.Event()  # set: the hang watch stops
    if spec.hang_watch_s == AUTO or spec.hang_watch_s > 0:
        watch = HangWatch(Path(spec.status_dir), spec.hang_watch_s)
        threading.Thread(target=watch.run, args=(watching,), name="agent-hang-watch", daemon=True).start()
    log.info("agent: serving run %s (slots %s, tier 1 %s)", spec.run_id, spec.memory_root, spec.local_root)
    agent._write_status()
    agent.serve()
    watching.set()
    agent.liveness_stop.set()  # its last datagram is a bye: the peers stop watching this node
    if agent.liveness_thread is not None:
        agent.liveness_thread.join(timeout=2)
    agent.stopping = True
    listener.close()
    worker.join()  # every accepted request is finished before the agent exits
    agent._write_status()
    log.info("agent: exiting")
    return 0


if __name__ == "__main__":  # pragma: no cover - python -m pretrain.checkpointing.agent.server
    sys.exit(main())
