"""What a peer without the run key, or a peer that sends garbage, can do to a receiving rank: two
real gloo ranks over TCP on loopback (rank 1 plays the peer). A replica pushed with another key is
refused on its header, 0 bytes committed, one error line on each side; a captured genuine header
altered in one byte no longer verifies; a header length of 2^40, a header of 10^6 pieces and a
name holding a NUL are refused before anything is allocated; after all of it, the next good
transfer on the same pair arrives byte-identical and is committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers import TEST_KEY, two_gloo_ranks
from tiering.collective import SingleProcess, TorchCollective
from tiering.peer.replication import PeerReplicator, primary_store, replica_store
from tiering.peer.run_key import RunKey
from tiering.peer.transport import CHANNEL, TAG_ACK, TAG_HEAD, TAG_SIZE, OutgoingStep, Transport
from tiering.publish import PosixStepPublisher, manifest_for
from tiering.system.fsio import write_file_durably

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
    word = torch.zeros(1, dtype=torch.int64)
    dist.irecv(word, src=0, tag=TAG_ACK).wait()
    return int(word.item())


def _header(published: Path, step: int, files: list[Any] | None = None) -> bytes:
    head = {"run_id": RUN, "step": step, "owner": 1, "kind": "replica"}
    body = json.loads(OutgoingStep.of(published, head).header_bytes(PIECE))
    if files is not None:
        body["files"] = files
    return json.dumps(body).encode()


def _signed(body: bytes) -> bytes:
    """What a peer holding the key sends (tests the bounds behind the tag)."""
    return TEST_KEY.for_channel(CHANNEL).tag(b"to:0\n" + body) + body


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
