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
process (``boot``) and a sequence number that only grows per boot: a datagram of another run, an
unknown node, a bad tag, an older sequence number or a boot the node left is dropped (a verified
beat of another attempt still shows its node alive; ``bye`` and ``lost`` count for their own
attempt only). A forged beat cannot be made without the key; a replayed one can at most keep a
lost node "alive" until NVRx's own timeouts, never get a rank killed. A forged ``lost`` needs the
key too.

Never: judges a node it has not heard from since the watch began (a firewall that drops the
datagrams, or a peer whose agent is older than this one, leaves lost nodes to NVRx's timeouts: one
warning), judges while datagrams that fail to verify flood in (the same: a flood can delay a
detection, never cause a kill), takes the silence of a node that said ``bye`` for a loss (a node
whose ranks ended repeats it for ``lost_after_s``),
kills a process other than the ranks that introduced themselves for the attempt being watched, or
judges before those ranks introduced the attempt's peers (start-up and restore are not watched).
:class:`PeerClock` is the rule, pure, tested on a fake clock.
"""

from __future__ import annotations

import contextlib
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
from collections import deque
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
RECEIVE_BATCH = 64  # datagrams read per turn at most: a flood cannot hold up the beats
FLOOD_DATAGRAMS = 256  # this many that fail to verify within lost_after_s suspend judging
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
    heard and then stayed silent for ``lost_after_s``; a node that said ``bye`` for this attempt
    is no longer watched. Any verified datagram of the run is a sign of life, whatever its attempt
    (a node whose agent has not switched to this attempt yet, or already switched to the next, is
    alive). Per node, the sequence numbers of its newest boot only grow, and a boot it left is
    never heard again (replays)."""

    def __init__(self, nodes: Iterable[str], lost_after_s: float, since: float) -> None:
        self.lost_after_s = lost_after_s
        self.since = since
        self.last: dict[str, float | None] = dict.fromkeys(nodes)
        self._seq: dict[str, tuple[str, int]] = {}  # node -> (boot, newest seq)
        self._retired: dict[str, set[str]] = {}  # node -> the boots it left

    def heard(self, beat: Beat, now: float, same_attempt: bool = True) -> bool:
        """Note ``beat`` from a watched node; False when it is not watched or not newer."""
        if beat.node not in self.last or beat.boot in self._retired.get(beat.node, ()):
            return False
        boot, seq = self._seq.get(beat.node, ("", -1))
        if beat.boot == boot and beat.seq <= seq:
            return False  # a replay, or out of order
        if boot and beat.boot != boot:
            self._retired.setdefault(beat.node, set()).add(boot)
        self._seq[beat.node] = (beat.boot, beat.seq)
        if beat.kind == "bye" and same_attempt:
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


@dataclass(frozen=True)
class Loss:
    """A decision taken under the lock, acted on outside it (kills, datagrams, the record)."""

    watch: Watch
    node: str
    silent_s: float | None
    told_by: str | None = None


class NodeLiveness:
    """The agent's side: a UDP socket, the current attempt's :class:`Watch`, and the loop that
    beats, listens and judges (:meth:`run`, on a thread of its own). A watch whose ranks ended (or
    that a newer attempt replaced) says ``bye`` at every beat for ``lost_after_s`` more, so that a
    lost datagram cannot make a peer still finishing its own take this node for lost. A flood of
    datagrams that do not verify suspends judging (one warning): it can delay a detection to
    NVRx's timeouts, never get a rank killed."""

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
        self.leaving: list[tuple[Watch, float]] = []  # watches that say bye, until when
        self.rejected: deque[float] = deque(maxlen=FLOOD_DATAGRAMS)  # when datagrams failed to verify
        self.lost_nodes: list[tuple[str, float]] = []  # every node this agent found lost, with its silence

    def introduce(self, message: Mapping[str, Any], key: RunKey, now: float | None = None) -> None:
        """A rank of this node introduced its attempt's peers (the agent's ``peers`` request): a
        newer attempt replaces the watch (the old one says bye); the same one adds the rank."""
        now = time.monotonic() if now is None else now
        attempt, node = str(message["attempt"]), str(message["node"])
        peers = {str(n): (str(h), int(p)) for n, (h, p) in dict(message["peers"]).items() if n != node}
        with self.lock:
            if self.watch is None or self.watch.attempt != attempt:
                if self.watch is not None:
                    self._leave(self.watch, now)
                nodes = watched_nodes(node, peers)
                clock = PeerClock(nodes, float(message["lost_after_s"]), now)
                channel = key.for_channel(CHANNEL)
                self.watch = Watch(attempt, node, {n: peers[n] for n in nodes}, clock, channel)
                log.info("liveness: attempt %s, node %s watches %s", attempt, node, nodes)
            self.watch.ranks[int(message["rank"])] = int(message["pid"])

    def run(self, stop: threading.Event) -> None:
        next_beat = 0.0
        while not stop.is_set():
            try:
                next_beat = self._turn(next_beat)
            except Exception:  # noqa: BLE001 - one bad turn must not end the node's pulse
                log.exception("liveness: a turn failed; going on")
                stop.wait(self.beat_s)
        with self.lock:  # the agent exits: every watch says bye, a few times (datagrams get lost)
            for watch in [w for w, _ in self.leaving] + ([self.watch] if self.watch else []):
                self._leave(watch, time.monotonic())
        for _ in range(3):
            self._beat(time.monotonic())
            time.sleep(0.02)
        self.sock.close()

    def _turn(self, next_beat: float) -> float:
        now = time.monotonic()
        if now >= next_beat:
            self._beat(now)
            next_beat = now + self.beat_s
        readable, _, _ = select.select([self.sock], [], [], max(0.0, next_beat - now))
        if readable:
            self.receive(time.monotonic())
        self.judge(time.monotonic())
        return next_beat

    def receive(self, now: float) -> None:
        """Up to ``RECEIVE_BATCH`` waiting datagrams (a flood cannot hold up the beats): beats
        noted, a ``lost`` for this attempt acted on."""
        losses = []
        for _ in range(RECEIVE_BATCH):
            try:
                data = self.sock.recv(MAX_DATAGRAM + 1, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            with self.lock:
                if (loss := self._note(data, now)) is not None:
                    losses.append(loss)
        for loss in losses:
            self._act(loss)

    def _note(self, data: bytes, now: float) -> Loss | None:
        watch = self.watch
        if watch is None:
            return None
        beat = decode(watch.key, data)
        if beat is None or beat.run != self.run_id:
            self.rejected.append(now)
            return None
        same = beat.attempt == watch.attempt
        if not watch.clock.heard(beat, now, same_attempt=same) or not same:
            return None
        if beat.kind == "lost" and beat.lost in watch.peers and beat.lost != watch.node:
            self.watch = None
            return Loss(watch, beat.lost, None, told_by=beat.node)
        return None

    def judge(self, now: float) -> None:
        loss = None
        with self.lock:
            watch = self.watch
            if watch is None:
                return
            if not any(is_running(pid) for pid in watch.ranks.values()):
                # The attempt's ranks ended (trained to the end, failed, restarted): the launcher's turn.
                self._leave(watch, now)
                self.watch = None
                return
            if self._flooded(now, watch):
                return
            lost = watch.clock.lost(now)
            if lost:
                self.watch = None
                loss = Loss(watch, lost[0][0], lost[0][1])
            else:
                self._warn_never_heard(now, watch)
        if loss is not None:
            self._act(loss)

    def _flooded(self, now: float, watch: Watch) -> bool:
        """Datagrams that failed to verify came too fast to trust the silence of any node."""
        window = watch.clock.lost_after_s
        flooded = len(self.rejected) == FLOOD_DATAGRAMS and now - self.rejected[0] < window
        if flooded and not watch.warned:
            watch.warned = True
            log.warning(
                "liveness: %d datagrams that are not this run's beats in %.1fs on port %d: lost nodes are left "
                "to NVRx's timeouts while they arrive; fix: keep other hosts off the job's network",
                FLOOD_DATAGRAMS, now - self.rejected[0], self.port,
            )  # fmt: skip
        return flooded

    def _warn_never_heard(self, now: float, watch: Watch) -> None:
        quiet = watch.clock.never_heard(now, max(5.0, 3 * watch.clock.lost_after_s))
        if quiet and not watch.warned:
            watch.warned = True
            log.warning(
                "liveness: no beat from %s since the attempt began; fix: let UDP from the job's nodes reach "
                "port %d (a lost node is found by NVRx's timeouts until then)", quiet, self.port
            )  # fmt: skip

    def _leave(self, watch: Watch, now: float) -> None:
        self.leaving.append((watch, now + watch.clock.lost_after_s + 2 * self.beat_s))

    def _act(self, loss: Loss) -> None:
        """``loss.node`` is lost: kill this node's ranks of the attempt, tell the others, record it."""
        watch = loss.watch
        killed = []
        for rank, pid in sorted(watch.ranks.items()):
            if is_running(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)
                    killed.append(rank)
        self.lost_nodes.append((loss.node, -1.0 if loss.silent_s is None else loss.silent_s))
        if loss.told_by is None:
            with self.lock:
                told = Beat(self.run_id, watch.attempt, watch.node, self.boot, self._next(), "lost", loss.node)
            for peer in watch.peers:
                self._send_to(watch, peer, told)
        how = f"silent for {loss.silent_s:.1f}s" if loss.silent_s is not None else f"reported lost by {loss.told_by}"
        log.warning(
            "liveness: node %s %s: killed this node's ranks %s of attempt %s", loss.node, how, killed, watch.attempt
        )
        record = {
            "event": "node_lost",
            "node": loss.node,
            "seen_by": watch.node,
            "silent_s": None if loss.silent_s is None else round(loss.silent_s, 2),
            "told_by": loss.told_by,
            "attempt": watch.attempt,
            "killed_ranks": killed,
            "time": time.time(),
        }
        try:
            append_jsonl(self.run_dir / "events.jsonl", record)
        except OSError as exc:
            log.warning("liveness: node_lost not recorded in %s: %s", self.run_dir, exc)

    def _beat(self, now: float) -> None:
        """One beat to every watched node; ``bye`` from every watch that is leaving."""
        sends = []
        with self.lock:
            self.leaving = [(w, until) for w, until in self.leaving if until > now]
            for watch, _ in self.leaving:
                sends.append((watch, Beat(self.run_id, watch.attempt, watch.node, self.boot, self._next(), "bye")))
            if self.watch is not None:
                watch = self.watch
                sends.append((watch, Beat(self.run_id, watch.attempt, watch.node, self.boot, self._next(), "beat")))
        for watch, beat in sends:
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
