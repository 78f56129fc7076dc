"""A lost node found in seconds: the node agents beat to each other, keyed with the run key.

A node that vanishes (power, kernel panic, its link down) sends no reset: its peers' ranks wait in
their next collective until a TCP, gloo or NVRx heartbeat timeout (8-60 s and more). The node's
checkpoint agent outlives its ranks and never holds their GIL, so it keeps the node's pulse: every
``BEAT_S`` it sends a small UDP datagram to the agents of the nodes it watches, and it notes when
each of them last beat. A watched node silent for ``lost_after_s`` (``fault_tolerance.node_lost_s``)
is lost: the agent SIGKILLs the ranks of the attempt on its own node (their sockets close, so every
other survivor's collective fails at once too, as after any killed rank), tells the other agents it
beats to, and records ``node_lost``. The launchers then restart without waiting for any timeout.

Who watches whom: every node every other node up to ``WATCH_ALL`` nodes; beyond, each node its
``RING`` neighbours on either side of the ring of node names (a lost node is seen by its
neighbours, whose ``lost`` message and killed ranks reach everyone else).

The channel (:mod:`tiering.trust.run_key`): every datagram is ``tag || body``, the tag HMAC-SHA256
under the run key's ``liveness`` channel key over the body, verified before the body is parsed.
The body binds the run id, the attempt, the sender's node, a random id of the sending agent
process (``boot``) and a sequence number that only grows per boot: a datagram of another run or
attempt, an unknown node, a bad tag or an older sequence number is dropped. A forged beat cannot
be made without the key; a replayed one can at most keep a lost node "alive" until NVRx's own
timeouts, never get a rank killed. A forged ``lost`` needs the key too.

Never: judges a node it has not heard from in this attempt (a firewall that drops the datagrams,
or a peer whose agent is older than this one, leaves lost nodes to NVRx's timeouts: one warning),
kills a process other than the ranks that introduced themselves for the attempt being watched, or
judges before those ranks introduced the attempt's peers (start-up and restore are not watched).
:class:`PeerClock` is the rule, pure, tested on a fake clock.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import select
import signal
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.observability.runlog import append_jsonl
from pretrain.platform.procfs import is_running
from tiering.trust.run_key import TAG_BYTES, RunKey

log = logging.getLogger(__name__)

BEAT_S = 0.2  # between two beats: ten fit in the default limit, so a busy node is not lost
WATCH_ALL = 16  # up to this many nodes every node watches every other one
RING = 2  # beyond: the neighbours watched on either side of the ring of node names
MAX_DATAGRAM = 2048  # larger datagrams are not ours
CHANNEL = "liveness"
KINDS = ("beat", "bye", "lost")


@dataclass(frozen=True)
class Beat:
    """One datagram's body: ``kind`` is ``beat``, ``bye`` (the agent exits: stop watching it) or
    ``lost`` (the sender found ``lost`` lost)."""

    run: str
    attempt: str
    node: str
    boot: str
    seq: int
    kind: str = "beat"
    lost: str = ""


def encode(key: RunKey, beat: Beat) -> bytes:
    body = json.dumps(beat.__dict__, separators=(",", ":")).encode()
    return key.tag(body) + body


def decode(key: RunKey, data: bytes) -> Beat | None:
    """The beat in ``data`` when its tag verifies and its fields are well formed; else None."""
    if len(data) <= TAG_BYTES or len(data) > MAX_DATAGRAM:
        return None
    tag, body = data[:TAG_BYTES], data[TAG_BYTES:]
    if not key.verify(body, tag):
        return None
    try:
        raw = json.loads(body)
        beat = Beat(**raw)
    except (ValueError, TypeError):
        return None
    texts = (beat.run, beat.attempt, beat.node, beat.boot, beat.kind, beat.lost)
    if not all(isinstance(t, str) for t in texts) or type(beat.seq) is not int or beat.kind not in KINDS:
        return None
    return beat


def watched_nodes(me: str, nodes: Iterable[str]) -> list[str]:
    """The nodes ``me`` watches and beats to among ``nodes`` (its own name included or not)."""
    ring = sorted(set(nodes) | {me})
    others = [n for n in ring if n != me]
    if len(ring) <= WATCH_ALL:
        return others
    i = ring.index(me)
    near = {ring[(i + d) % len(ring)] for d in range(-RING, RING + 1) if d}
    return sorted(near)


class PeerClock:
    """When each watched node last beat, on this node's monotonic clock. A node is lost once it was
    heard in this attempt and then stayed silent for ``lost_after_s``; a node that said ``bye`` is
    no longer watched."""

    def __init__(self, nodes: Iterable[str], lost_after_s: float, since: float) -> None:
        self.lost_after_s = lost_after_s
        self.since = since
        self.last: dict[str, float | None] = dict.fromkeys(nodes)
        self._seq: dict[str, tuple[str, int]] = {}  # node -> (boot, newest seq)

    def heard(self, beat: Beat, now: float) -> bool:
        """Note ``beat`` from a watched node; False when it is not watched or not newer."""
        if beat.node not in self.last:
            return False
        boot, seq = self._seq.get(beat.node, ("", -1))
        if beat.boot == boot and beat.seq <= seq:
            return False  # a replay, or out of order
        self._seq[beat.node] = (beat.boot, beat.seq)
        if beat.kind == "bye":
            del self.last[beat.node]
        else:
            self.last[beat.node] = now
        return True

    def lost(self, now: float) -> list[tuple[str, float]]:
        """Watched nodes heard once and silent past the limit: (node, seconds silent)."""
        return sorted((node, now - t) for node, t in self.last.items() if t is not None and now - t > self.lost_after_s)

    def never_heard(self, now: float, grace_s: float) -> list[str]:
        """Watched nodes not heard in ``grace_s`` since the watch began."""
        return sorted(n for n, t in self.last.items() if t is None) if now - self.since > grace_s else []


@dataclass
class Watch:
    """One attempt's watch on this node: the peers' addresses, the clock, the ranks to kill."""

    attempt: str
    node: str
    peers: dict[str, tuple[str, int]]  # node -> its agent's (host, port)
    clock: PeerClock
    key: RunKey
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> pid
    warned: bool = False


class NodeLiveness:
    """The agent's side: a UDP socket, the current attempt's :class:`Watch`, and the loop that
    beats, listens and judges (:meth:`run`, on a thread of its own)."""

    def __init__(self, run_id: str, run_dir: Path, beat_s: float = BEAT_S) -> None:
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.beat_s = beat_s
        self.boot = secrets.token_hex(8)
        self.seq = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))  # noqa: S104 - peers reach it on the job's network; beats are keyed
        self.port: int = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.watch: Watch | None = None
        self.lost_nodes: list[tuple[str, float]] = []  # every node this agent found lost, with its silence

    def introduce(self, message: Mapping[str, Any], key: RunKey, now: float | None = None) -> None:
        """A rank of this node introduced its attempt's peers (the agent's ``peers`` request): a
        newer attempt replaces the watch; the same one adds the rank."""
        now = time.monotonic() if now is None else now
        attempt, node = str(message["attempt"]), str(message["node"])
        peers = {str(n): (str(h), int(p)) for n, (h, p) in dict(message["peers"]).items() if n != node}
        with self.lock:
            if self.watch is None or self.watch.attempt != attempt:
                nodes = watched_nodes(node, peers)
                clock = PeerClock(nodes, float(message["lost_after_s"]), now)
                channel = key.for_channel(CHANNEL)
                self.watch = Watch(attempt, node, {n: peers[n] for n in nodes}, clock, channel)
                log.info("liveness: attempt %s, node %s watches %s", attempt, node, nodes)
            self.watch.ranks[int(message["rank"])] = int(message["pid"])

    def run(self, stop: threading.Event) -> None:
        next_beat = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send("beat")
                next_beat = now + self.beat_s
            readable, _, _ = select.select([self.sock], [], [], max(0.0, min(next_beat - now, self.beat_s)))
            if readable:
                self.receive(time.monotonic())
            self.judge(time.monotonic())
        self._send("bye")
        self.sock.close()

    def receive(self, now: float) -> None:
        """Every datagram waiting: beats noted, a ``lost`` acted on."""
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM + 1, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            with self.lock:
                watch = self.watch
                beat = decode(watch.key, data) if watch is not None else None
                if watch is None or beat is None or beat.run != self.run_id or beat.attempt != watch.attempt:
                    continue
                if not watch.clock.heard(beat, now):
                    continue
                if beat.kind == "lost" and beat.lost in watch.peers and beat.lost != watch.node:
                    self._lost(watch, beat.lost, None, told_by=beat.node)

    def judge(self, now: float) -> None:
        with self.lock:
            watch = self.watch
            if watch is None:
                return
            if not any(is_running(pid) for pid in watch.ranks.values()):
                # The attempt's ranks ended (trained to the end, failed, restarted): the launcher's
                # turn. ``bye``, so that no peer still finishing its own takes this silence for a loss.
                self._send_locked(watch, "bye")
                self.watch = None
                return
            lost = watch.clock.lost(now)
            if lost:
                self._lost(watch, lost[0][0], lost[0][1])
                return
            quiet = watch.clock.never_heard(now, max(5.0, 3 * watch.clock.lost_after_s))
            if quiet and not watch.warned:
                watch.warned = True
                log.warning(
                    "liveness: no beat from %s since the attempt began; fix: let UDP from the job's nodes reach "
                    "port %d (a lost node is found by NVRx's timeouts until then)", quiet, self.port
                )  # fmt: skip

    def _lost(self, watch: Watch, node: str, silent_s: float | None, told_by: str | None = None) -> None:
        """``node`` is lost: kill this node's ranks of the attempt, tell the others, record it."""
        killed = []
        for rank, pid in sorted(watch.ranks.items()):
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
                killed.append(rank)
        self.watch = None
        self.lost_nodes.append((node, -1.0 if silent_s is None else silent_s))
        if told_by is None:
            told = Beat(self.run_id, watch.attempt, watch.node, self.boot, self._next(), "lost", node)
            for peer in watch.peers:
                self._send_to(watch, peer, told)
        how = f"silent for {silent_s:.1f}s" if silent_s is not None else f"reported lost by {told_by}"
        log.warning("liveness: node %s %s: killed this node's ranks %s of attempt %s", node, how, killed, watch.attempt)
        append_jsonl(
            self.run_dir / "events.jsonl",
            {
                "event": "node_lost",
                "node": node,
                "seen_by": watch.node,
                "silent_s": None if silent_s is None else round(silent_s, 2),
                "told_by": told_by,
                "attempt": watch.attempt,
                "killed_ranks": killed,
                "time": time.time(),
            },
        )

    def _send(self, kind: str) -> None:
        with self.lock:
            if self.watch is not None:
                self._send_locked(self.watch, kind)

    def _send_locked(self, watch: Watch, kind: str) -> None:
        beat = Beat(self.run_id, watch.attempt, watch.node, self.boot, self._next(), kind)
        for peer in watch.peers:
            self._send_to(watch, peer, beat)

    def _send_to(self, watch: Watch, peer: str, beat: Beat) -> None:
        host, port = watch.peers[peer]
        try:
            self.sock.sendto(encode(watch.key, beat), (host, port))
        except OSError as exc:  # unreachable, unresolvable: silence, judged like any other
            log.debug("liveness: beat to %s (%s:%d) not sent: %s", peer, host, port, exc)

    def _next(self) -> int:
        self.seq += 1
        return self.seq


def advertised_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The address this node's peers reach it at: the local address of the route to
    ``MASTER_ADDR`` (the job's network), or ``MASTER_ADDR`` itself where that route is loopback
    (this node is the master, and its peers resolve that name). None without ``MASTER_ADDR``."""
    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR", "")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # no packet is sent: only the route is looked up
            local = probe.getsockname()[0]
    except OSError:
        return None
    return master if ipaddress.ip_address(local).is_loopback else local
