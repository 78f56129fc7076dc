"""What a peer without the run key, or a peer that sends garbage, can do to a receiving rank: two
real gloo ranks over TCP on loopback (rank 1 plays the peer). A replica pushed with another key is
refused on its header, 0 bytes committed, one error line on each side; a captured genuine header
altered in one byte no longer verifies; a header length of 2^40, a header of 10^6 pieces and a
name holding a NUL are refused before anything is allocated; after all of it, the next good
transfer on the same pair arrives byte-identical and is committed. A receiver without the key that
takes any header and answers it gets none of the step (its accept word does not verify); two ranks
with different keys that push to each other both refuse at once, and the pair stays clean."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers import TEST_KEY, two_gloo_ranks
from tiering.collective import SingleProcess, TorchCollective
from tiering.local.posix import primary_store, replica_store
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.peer.replication import PeerReplicator
from tiering.peer.transport import CHANNEL, NONCE_BYTES, TAG_ACK, TAG_HEAD, TAG_SIZE, OutgoingStep, Transport
from tiering.system.fsio import write_file_durably
from tiering.trust.run_key import TAG_BYTES, RunKey

RUN = "trust"
CHUNK = 64 * 1024
PIECE = 4 * CHUNK
HOLDERS = {1: [0]}  # rank 1's steps are held by rank 0
PAYLOAD = {"state.bin": bytes(range(256)) * 4096, "nested/extra.bin": b"x" * 1000}


def _publish(node_root: Path, step: int) -> Path:
    layout = primary_store(node_root, 1, RUN, 3).layout
    pub = PosixStepPublisher(layout, SingleProcess(), "w1")
    tmp = pub.begin(step)
    known = {}
    for rel, data in PAYLOAD.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        known[rel] = write_file_durably(tmp / rel, lambda fh, d=data: fh.write(d))
    pub.commit(tmp, manifest_for(RUN, step, 2, {"tp": 1, "pp": 1, "dp": 2}, extra={"owner_rank": 1}), known=known)
    return layout.step_dir(step)


def _raw_push(size: int, blob: bytes) -> int:
    """A peer that speaks the wire by hand: a header size word, the header bytes (if any), then the
    receiver's accept word."""
    dist.isend(torch.tensor([size], dtype=torch.int64), dst=0, tag=TAG_SIZE).wait()
    if blob:
        dist.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=0, tag=TAG_HEAD).wait()
    word = torch.zeros(TAG_BYTES, dtype=torch.uint8)
    dist.irecv(word, src=0, tag=TAG_ACK).wait()
    return int(bool(word.any()))  # zeros: refused


def _header(published: Path, step: int, files: list[Any] | None = None) -> bytes:
    head = {"run_id": RUN, "step": step, "owner": 1, "kind": "replica"}
    body = json.loads(OutgoingStep.of(published, head).header_bytes(PIECE))
    if files is not None:
        body["files"] = files
    return json.dumps(body).encode()


def _signed(body: bytes) -> bytes:
    """What a peer holding the key sends (tests the bounds behind the tag)."""
    nonced = secrets.token_bytes(NONCE_BYTES) + body
    return TEST_KEY.for_channel(CHANNEL).tag(b"to:0\n" + nonced) + nonced


def _rogue(root: Path, group: Any) -> dict[str, Any]:
    published = _publish(root / "node-1", 10)
    out: dict[str, Any] = {}
    forger = Transport(group, 20, piece=PIECE, key=RunKey.generate())  # not this run's key
    report = PeerReplicator(RUN, 1, HOLDERS, root / "node-1", forger, TorchCollective(group), 3, "a").replicate(
        10, published
    )
    out["forged_report"] = report.failures
    captured = _signed(_header(published, 10))  # a genuine header, as read off the wire
    altered = captured.replace(b'"step": 10', b'"step": 99')
    out["altered_ack"] = _raw_push(len(altered), altered)
    out["huge_ack"] = _raw_push(2**40, b"")
    many = _signed(_header(published, 10, [["state.bin", 10**6, 1]]))
    out["many_ack"] = _raw_push(len(many), many)
    nul = _signed(_header(published, 10, [["state\x00.bin", 3, 3]]))
    out["nul_ack"] = _raw_push(len(nul), nul)
    honest = Transport(group, 20, piece=PIECE, key=TEST_KEY)
    report = PeerReplicator(RUN, 1, HOLDERS, root / "node-1", honest, TorchCollective(group), 3, "b").replicate(
        10, published
    )
    out["good_report"] = report.failures
    return out


def _holder(root: Path, group: Any) -> dict[str, Any]:
    node_root = root / "node-0"
    transport = Transport(group, 20, piece=PIECE, key=TEST_KEY)
    store = replica_store(node_root, 1, RUN, 3)
    out: dict[str, Any] = {}
    rep = PeerReplicator(RUN, 0, HOLDERS, node_root, transport, TorchCollective(group), 3, "a")
    out["forged"] = rep.replicate(10, None).failures
    out["forged_steps"] = store.step_dirs()
    out["forged_bytes"] = sum(p.stat().st_size for p in node_root.rglob("*") if p.is_file())
    for name in ("altered", "huge", "many", "nul"):
        received, errors = transport.exchange({}, {1: node_root / f"rx-{name}"})
        out[name] = {"received": sorted(received), "errors": errors, "left": (node_root / f"rx-{name}").exists()}
    rep = PeerReplicator(RUN, 0, HOLDERS, node_root, transport, TorchCollective(group), 3, "b")
    out["good"] = rep.replicate(10, None).failures
    step_dir = store.step_path(10)
    out["good_same"] = {rel: (step_dir / rel).read_bytes() == data for rel, data in PAYLOAD.items()}
    return out


def _scenario(rank: int, root: Path) -> dict[str, Any]:
    return (_holder if rank == 0 else _rogue)(root, dist.group.WORLD)


def test_a_forged_or_garbage_transfer_is_refused_and_the_next_good_one_commits(tmp_path: Path) -> None:
    holder, rogue = two_gloo_ranks(_scenario, tmp_path)
    forged = holder["forged"]["1"]
    assert "run-key tag does not verify" in forged and "\n" not in forged, forged
    assert holder["forged_steps"] == [] and holder["forged_bytes"] == 0, "0 bytes of the forged replica committed"
    assert "refused the header" in rogue["forged_report"]["1"], rogue["forged_report"]
    for name, needle in (
        ("altered", "run-key tag does not verify"),
        ("huge", "refused a header of 1099511627776 bytes"),
        ("many", "over 100000 pieces"),
        ("nul", "control character"),
    ):
        row = holder[name]
        line = row["errors"]["1"]
        assert needle in line and "\n" not in line, (name, line)
        assert row["received"] == [] and not row["left"], (name, row)
        assert rogue[f"{name}_ack"] == 0, f"{name}: the peer is told its header was refused"
    assert holder["good"] == {} and rogue["good_report"] == {}, (holder["good"], rogue["good_report"])
    assert holder["good_same"] == {rel: True for rel in PAYLOAD}, "the next good transfer arrives identical"


class _Taker(Transport):
    """A receiver without the run key that takes any header as it comes (no tag check) and answers
    it as a holder of its own key would: what a rogue that connected to pull replicas can do."""

    def _verified_header(self, blob: bytes) -> dict[str, Any]:
        head = json.loads(blob[TAG_BYTES + NONCE_BYTES :].decode("utf-8"))
        head["files"] = [tuple(f) for f in head["files"]]
        return head


def _pull(rank: int, root: Path) -> dict[str, Any]:
    """Rank 0 (the job's) sends its step to rank 1, which does not hold the key but answers."""
    group = dist.group.WORLD
    node = root / f"node-{rank}"
    if rank == 0:
        published = _publish(node, 10)  # rank 0 stands in for owner 1's layout: only the bytes matter
        step = OutgoingStep.of(published, {"run_id": RUN, "step": 10, "owner": 1, "kind": "replica"})
        _, errors = Transport(group, 20, piece=PIECE, key=TEST_KEY).exchange({1: step}, {})
        return {"errors": errors}
    received, errors = _Taker(group, 3, piece=PIECE, key=RunKey.generate()).exchange({}, {0: node / "rx"})
    got = [p.read_bytes() for p in (node / "rx").rglob("*") if p.is_file()] if (node / "rx").exists() else []
    seen = any(PAYLOAD["state.bin"][:4096] in data for data in got)
    return {"received": sorted(received), "errors": errors, "bytes": sum(map(len, got)), "seen": seen}


def test_a_receiver_without_the_key_gets_none_of_the_step(tmp_path: Path) -> None:
    sender, rogue = two_gloo_ranks(_pull, tmp_path)
    line = sender["errors"]["1"]
    assert "did not prove it holds the run key" in line and "nothing sent" in line and "\n" not in line, line
    assert rogue["received"] == [] and rogue["bytes"] == 0 and not rogue["seen"], rogue
    assert "0" in rogue["errors"], "the rogue's wait for pieces that never come ends in an error"


def _mutual(rank: int, root: Path) -> dict[str, Any]:
    """Both ranks hold different keys and push to each other in one exchange; then both hold the
    run key and push again on the same pair."""
    group = dist.group.WORLD
    mine = _publish(root / f"node-{rank}", 20)
    step = OutgoingStep.of(mine, {"run_id": RUN, "step": 20, "owner": 1, "kind": "replica"})
    peer = 1 - rank
    t0 = time.monotonic()
    received, errors = Transport(group, 20, piece=PIECE, key=RunKey.generate()).exchange(
        {peer: step}, {peer: root / f"mutual-rx-{rank}"}
    )
    out: dict[str, Any] = {"errors": errors, "seconds": time.monotonic() - t0, "received": sorted(received)}
    received, out["after_errors"] = Transport(group, 20, piece=PIECE, key=TEST_KEY).exchange(
        {peer: step}, {peer: root / f"after-rx-{rank}"}
    )
    out["after_same"] = sorted(received) == [peer] and all(
        (received[peer].directory / rel).read_bytes() == data for rel, data in PAYLOAD.items()
    )
    return out


def test_a_mutual_refusal_ends_at_once_and_leaves_the_pair_clean(tmp_path: Path) -> None:
    for rank, side in enumerate(two_gloo_ranks(_mutual, tmp_path)):
        line = side["errors"][str(1 - rank)]
        assert "run-key tag does not verify" in line and "refused the header sent to it" in line, line
        assert "\n" not in line and side["received"] == [] and side["seconds"] < 10, (side["seconds"], line)
        assert side["after_errors"] == {} and side["after_same"], side["after_errors"]
