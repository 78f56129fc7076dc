"""The node liveness: node agents beat to each other over UDP, keyed with the run key; a node that
stops beating is lost, and the ranks of the attempt on the nodes that saw it are killed at once.

In one process: the rule on a fake clock at its boundaries (just under and just over the limit, a
node never heard, a replay, a replayed boot the node left, a ``bye``, another attempt's datagrams),
the datagram's tag (another key, another channel, a flipped byte, malformed fields), and who
watches whom. On real sockets and real processes:

* a peer agent SIGKILLed (a forked process, so no ``bye`` is sent) is found lost within the limit
  while forged beats in its name arrive; this node's rank of the attempt (a real process) is
  killed and the ``node_lost`` event names the node;
* a peer whose ranks ended says ``bye``, repeated for the limit, and is never counted lost;
* a verified ``lost`` from a peer kills this node's ranks too, a forged one does not;
* a peer never heard kills nothing; a node that switched attempts first (in-process restart) is
  not lost; a flood of unverifiable datagrams gets no rank killed;
* a rank's introduction through a real agent process makes that agent beat to the other node.

The end-to-end case (two netns nodes, a link cut) is in ``tests/test_cluster_memory_peer.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pretrain.checkpointing.agent.client import AgentLink, introduce_nodes
from pretrain.checkpointing.agent.server import AgentSpec
from pretrain.resilience.node_liveness import (
    BEAT_S,
    CHANNEL,
    Beat,
    NodeLiveness,
    PeerClock,
    advertised_host,
    decode,
    encode,
    watched_nodes,
)
from tests.helpers import agents_serving, read_jsonl
from tiering.trust.run_key import RunKey
from tiering.trust.run_key import load as load_run_key

KEY = RunKey.generate()
RUN = "run"
LOST_S = 1.0


def _beat(node: str = "n1", seq: int = 1, boot: str = "b", kind: str = "beat") -> Beat:
    return Beat("run", "a1", node, boot, seq, kind)


def test_a_node_is_lost_once_heard_and_silent_just_over_the_limit() -> None:
    clock = PeerClock(["n1", "n2"], lost_after_s=2.0, since=0.0)
    assert clock.heard(_beat("n1"), now=10.0)
    assert clock.lost(12.0) == []  # exactly at the limit: not yet
    assert clock.lost(12.01) == [("n1", pytest.approx(2.01))]
    # n2 was never heard: never lost (a dropped channel is NVRx's business), named after the grace
    assert clock.never_heard(4.9, grace_s=5.0) == [] and clock.never_heard(5.1, grace_s=5.0) == ["n2"]
    assert not clock.heard(_beat("n9"), now=11.0)  # not watched


def test_replays_are_ignored_a_new_boot_is_heard_and_bye_ends_the_watch() -> None:
    clock = PeerClock(["n1"], lost_after_s=2.0, since=0.0)
    assert clock.heard(_beat(seq=5), now=1.0)
    assert not clock.heard(_beat(seq=5), now=2.5) and not clock.heard(_beat(seq=3), now=2.5)
    assert clock.lost(3.5) == [("n1", 2.5)]  # the replays kept nothing alive
    assert clock.heard(_beat(seq=1, boot="restarted"), now=3.6)  # a new agent on that node
    assert clock.lost(4.0) == []
    assert not clock.heard(_beat(seq=99, boot="b"), now=3.7)  # the boot it left, replayed
    assert clock.heard(_beat(seq=2, boot="restarted", kind="bye"), now=4.1)
    assert clock.lost(100.0) == [] and clock.never_heard(100.0, grace_s=5.0) == []


def test_any_attempts_beat_is_life_but_only_this_attempts_bye_ends_the_watch() -> None:
    """In-process restarts keep the processes: one node's agent may switch to the next attempt
    before another's. Its beats still show it alive; its old attempt's bye ends nothing."""
    clock = PeerClock(["n1"], lost_after_s=2.0, since=0.0)
    assert clock.heard(_beat(seq=1), now=1.0, same_attempt=False)
    assert clock.heard(_beat(seq=2, kind="bye"), now=2.5, same_attempt=False)
    assert clock.lost(4.4) == [] and clock.lost(4.6) == [("n1", pytest.approx(2.1))]
    assert clock.heard(_beat(seq=3, kind="bye"), now=4.7, same_attempt=True)
    assert clock.lost(100.0) == []


def test_a_datagram_is_acted_on_only_with_this_runs_liveness_tag_and_well_formed_fields() -> None:
    key = KEY.for_channel(CHANNEL)
    good = encode(key, _beat())
    assert decode(key, good) == _beat()
    assert decode(RunKey.generate().for_channel(CHANNEL), good) is None  # another run's key
    assert decode(KEY.for_channel("transport"), good) is None  # another channel of this run
    flipped = bytearray(good)
    flipped[-3] ^= 1
    assert decode(key, bytes(flipped)) is None
    assert decode(key, good[:10]) is None and decode(key, good + b" " * 4096) is None
    for body in (b'{"run": 1}', b"[1, 2]", b"not json", json.dumps({**_beat().__dict__, "seq": "7"}).encode()):
        assert decode(key, key.tag(body) + body) is None, body
    wrong_kind = json.dumps({**_beat().__dict__, "kind": "kill"}).encode()
    assert decode(key, key.tag(wrong_kind) + wrong_kind) is None


def test_every_node_watches_every_other_up_to_sixteen_then_its_ring_neighbours() -> None:
    small = [f"n{i:02d}" for i in range(16)]
    assert watched_nodes("n03", small) == [n for n in small if n != "n03"]
    large = [f"n{i:02d}" for i in range(40)]
    assert watched_nodes("n00", large) == ["n01", "n02", "n38", "n39"]
    assert watched_nodes("n20", large) == ["n18", "n19", "n21", "n22"]


def test_the_advertised_host_is_the_route_to_the_master_or_the_masters_own_name() -> None:
    assert advertised_host({}) is None
    assert advertised_host({"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"  # the master: peers resolve its name
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed (no packet sent), never answered
        except OSError:
            pytest.skip("no IPv4 route on this machine")
        local = probe.getsockname()[0]
    assert advertised_host({"MASTER_ADDR": "192.0.2.1"}) == local


# -- real sockets, real processes ---------------------------------------------------------------


def _introduce(agent: NodeLiveness, node: str, peers: dict[str, NodeLiveness], rank_pid: int) -> None:
    where = {n: ("127.0.0.1", p.port) for n, p in peers.items()}
    message = {"attempt": "a1", "node": node, "peers": where, "lost_after_s": LOST_S, "rank": 0, "pid": rank_pid}
    agent.introduce(message, KEY)


@contextlib.contextmanager
def _running(agent: NodeLiveness) -> Iterator[threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(5)


@contextlib.contextmanager
def _rank() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _forked_peer(peer: NodeLiveness, node: str, partner: NodeLiveness) -> int:
    """``peer`` beating from a forked process (SIGKILL it to lose the node: no ``bye``)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _introduce(peer, node, {"A": partner}, os.getpid())
            peer.run(threading.Event())
        finally:
            os._exit(0)
    peer.sock.close()
    return pid


def _wait(what: str, condition: object, timeout: float) -> float:
    start = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, f"{what} within {timeout}s"
        time.sleep(0.02)
    return time.monotonic() - start


def _forge_beats(target_port: int, node: str, stop: threading.Event) -> None:
    """Beats in ``node``'s name under another key, as a pod without the run key would send."""
    other = RunKey.generate().for_channel(CHANNEL)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        seq = 10_000
        while not stop.wait(0.05):
            seq += 1
            sock.sendto(encode(other, Beat("run", "a1", node, "forged", seq)), ("127.0.0.1", target_port))


def test_a_killed_peer_is_found_lost_within_the_limit_and_this_nodes_rank_is_killed(tmp_path: Path) -> None:
    a, b = NodeLiveness("run", tmp_path), NodeLiveness("run", tmp_path)
    with _rank() as rank:
        _introduce(a, "A", {"B": b}, rank.pid)
        peer = _forked_peer(b, "B", a)
        forging = threading.Event()
        try:
            with _running(a):
                _wait("A hears B", lambda: a.watch is not None and a.watch.clock.last.get("B") is not None, 10)
                time.sleep(1.5 * LOST_S)  # beating on: nothing is lost
                assert rank.poll() is None and a.lost_nodes == []
                threading.Thread(target=_forge_beats, args=(a.port, "B", forging), daemon=True).start()
                os.kill(peer, signal.SIGKILL)
                took = _wait("A kills its rank", lambda: rank.poll() is not None, 10)
        finally:
            forging.set()
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer, signal.SIGKILL)
            os.waitpid(peer, 0)
    assert rank.returncode == -signal.SIGKILL
    assert LOST_S - BEAT_S <= took < LOST_S + 1.5, took  # its last beat left up to one beat before the kill
    [event] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "node_lost"]
    assert (event["node"], event["seen_by"], event["killed_ranks"], event["attempt"]) == ("B", "A", [0], "a1")
    assert LOST_S <= event["silent_s"] < LOST_S + 1.0, event
    print("NODE_LOST_DETECTION_S", round(took, 2))


def test_a_peer_whose_ranks_ended_says_bye_and_is_never_counted_lost(tmp_path: Path) -> None:
    a, b = NodeLiveness("run", tmp_path), NodeLiveness("run", tmp_path)
    with _rank() as rank_a, _rank() as rank_b:
        _introduce(a, "A", {"B": b}, rank_a.pid)
        _introduce(b, "B", {"A": a}, rank_b.pid)
        with _running(a), _running(b):
            _wait("A hears B", lambda: a.watch is not None and a.watch.clock.last.get("B") is not None, 10)
            rank_b.kill()  # B's ranks trained to their end (or failed): B's agent says bye
            rank_b.wait()
            _wait("B's bye reaches A", lambda: a.watch is not None and "B" not in a.watch.clock.last, 10)
            time.sleep(2 * LOST_S)
            assert rank_a.poll() is None
    assert a.lost_nodes == [] and not (tmp_path / "events.jsonl").exists()


def test_a_lost_told_by_a_peer_kills_this_nodes_ranks_and_a_forged_one_does_not(tmp_path: Path) -> None:
    a = NodeLiveness("run", tmp_path)
    with _rank() as rank, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer_sock:
        peer_sock.bind(("127.0.0.1", 0))
        where = {"B": ("127.0.0.1", peer_sock.getsockname()[1]), "C": ("127.0.0.1", 9)}
        a.introduce({"attempt": "a1", "node": "A", "peers": where, "lost_after_s": 60, "rank": 3, "pid": rank.pid}, KEY)
        forged = Beat("run", "a1", "B", "b", 1, "lost", "C")
        with _running(a):
            peer_sock.sendto(encode(RunKey.generate().for_channel(CHANNEL), forged), ("127.0.0.1", a.port))
            time.sleep(0.5)
            assert rank.poll() is None
            told = Beat("run", "a1", "B", "b", 2, "lost", "C")
            peer_sock.sendto(encode(KEY.for_channel(CHANNEL), told), ("127.0.0.1", a.port))
            _wait("A kills its rank", lambda: rank.poll() is not None, 5)
    [event] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "node_lost"]
    assert (event["node"], event["told_by"], event["killed_ranks"]) == ("C", "B", [3])


def test_a_peer_never_heard_kills_nothing(tmp_path: Path) -> None:
    a = NodeLiveness("run", tmp_path)
    with _rank() as rank:
        # B's address drops every datagram (nothing listens): a firewall that blocks the beats
        a.introduce(
            {
                "attempt": "a1",
                "node": "A",
                "peers": {"B": ("127.0.0.1", 9)},
                "lost_after_s": LOST_S,
                "rank": 0,
                "pid": rank.pid,
            },
            KEY,
        )
        with _running(a):
            time.sleep(2 * LOST_S)
            assert rank.poll() is None and a.lost_nodes == []


class _TwoNodes:
    """The rank's collective in a two-node job, the other node's row given (a Collective)."""

    rank, world_size = 0, 2

    def __init__(self, other: tuple[str, str, int]) -> None:
        self.other = other

    def all_gather(self, obj: object) -> list[object]:
        return [obj, self.other]


def test_a_ranks_introduction_makes_its_agent_beat_to_the_other_node_and_a_readable_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank's side through a real agent process: ``liveness`` and ``peers``, then the agent's
    beats arrive at the other node's address under the run key (heard by a NodeLiveness standing
    for that node's agent). A key file others may read is refused by the agent: no watch."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    key_file = tmp_path / "run.key"
    key_file.write_bytes(b"k" * 32)
    key_file.chmod(0o600)
    key = load_run_key(key_file)
    other = NodeLiveness(RUN, tmp_path / "other")
    spec = AgentSpec(RUN, str(tmp_path / "shm"), str(tmp_path / "ckpt"), 3, 2, str(tmp_path / "runs"), 0.5, 1)
    link = AgentLink(spec)
    try:
        port = int(link.request({"op": "liveness"})["port"])
        other.introduce(
            {
                "attempt": "a1",
                "node": "node-b",
                "peers": {"node-a": ("127.0.0.1", port)},
                "lost_after_s": 60,
                "rank": 1,
                "pid": os.getpid(),
            },
            key,
        )
        with _running(other):
            coll = _TwoNodes(("node-b", "127.0.0.1", other.port))
            assert introduce_nodes(link, coll, "node-a", "a1", key_file, 60.0)
            _wait(
                "the agent's beats reach node-b",
                lambda: other.watch and other.watch.clock.last["node-a"] is not None,
                10,
            )
            key_file.chmod(0o644)
            assert not introduce_nodes(link, coll, "node-a", "a2", key_file, 60.0)
    finally:
        link.close()
        _wait("the agent exits", lambda: not agents_serving(tmp_path / "shm"), 20)


def test_a_node_whose_ranks_ended_repeats_its_bye_for_the_limit(tmp_path: Path) -> None:
    """One lost ``bye`` must not get a peer that is still finishing killed: the bye is repeated at
    every beat for ``lost_after_s`` (counted on a socket standing for the peer's agent)."""
    a = NodeLiveness(RUN, tmp_path)
    key = KEY.for_channel(CHANNEL)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer, _rank() as rank:
        peer.bind(("127.0.0.1", 0))
        peer.settimeout(0.5)
        where = {"B": ("127.0.0.1", peer.getsockname()[1])}
        message = {"attempt": "a1", "node": "A", "peers": where, "lost_after_s": LOST_S, "rank": 0, "pid": rank.pid}
        a.introduce(message, KEY)
        with _running(a):
            rank.kill()
            rank.wait()
            byes, deadline = [], time.monotonic() + LOST_S + 1.0
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    beat = decode(key, peer.recv(4096))
                    if beat is not None and beat.kind == "bye":
                        byes.append(time.monotonic())
    assert len(byes) >= 3 and byes[-1] - byes[0] >= LOST_S - 2 * BEAT_S, byes


def test_a_node_that_switched_attempt_first_with_the_same_processes_is_not_lost(tmp_path: Path) -> None:
    """In-process restart: A's agent is introduced to attempt a2 by the same rank process while B's
    still watches a1. B hears A's a2 beats as life and kills nothing."""
    a, b = NodeLiveness(RUN, tmp_path), NodeLiveness(RUN, tmp_path)
    with _rank() as rank_a, _rank() as rank_b:
        _introduce(a, "A", {"B": b}, rank_a.pid)
        _introduce(b, "B", {"A": a}, rank_b.pid)
        with _running(a), _running(b):
            _wait("B hears A", lambda: b.watch is not None and b.watch.clock.last.get("A") is not None, 10)
            where = {"B": ("127.0.0.1", b.port)}
            message = {
                "attempt": "a2",
                "node": "A",
                "peers": where,
                "lost_after_s": LOST_S,
                "rank": 0,
                "pid": rank_a.pid,
            }
            a.introduce(message, KEY)
            time.sleep(2.5 * LOST_S)
            assert rank_a.poll() is None and rank_b.poll() is None
    assert a.lost_nodes == [] and b.lost_nodes == []


def test_a_flood_without_the_key_holds_up_no_beat_and_gets_no_rank_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Datagrams that do not verify, as fast as one Python thread sends them, at A: A keeps
    beating (B never finds it lost) and A's own judging is suspended while they arrive, with one
    warning. (One Python sender does not outrun the receiver here; a native one did, before each
    turn read at most ``RECEIVE_BATCH`` datagrams: that bound is what keeps the beats going.)"""
    a, b = NodeLiveness(RUN, tmp_path), NodeLiveness(RUN, tmp_path)
    stop = threading.Event()

    def flood() -> None:
        junk = os.urandom(200)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            while not stop.is_set():
                for _ in range(100):
                    sock.sendto(junk, ("127.0.0.1", a.port))

    with _rank() as rank_a, _rank() as rank_b:
        _introduce(a, "A", {"B": b}, rank_a.pid)
        _introduce(b, "B", {"A": a}, rank_b.pid)
        with _running(a), _running(b):
            _wait("B hears A", lambda: b.watch is not None and b.watch.clock.last.get("A") is not None, 10)
            flooder = threading.Thread(target=flood, daemon=True)
            flooder.start()
            try:
                time.sleep(3 * LOST_S)
            finally:
                stop.set()
                flooder.join(5)
            assert rank_a.poll() is None and rank_b.poll() is None
    assert a.lost_nodes == [] and b.lost_nodes == []
    assert [r for r in caplog.records if "datagrams that are not this run's beats" in r.getMessage()], caplog.text
