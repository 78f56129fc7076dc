"""The streamed step transport between two real gloo ranks: files of awkward sizes travel both ways
at once in many small pieces (every send buffer reused) and arrive byte-identical; every corruption
on the wire is rejected on arrival and never committed; a bad copy a peer serves for a restore is
caught while it is read, quarantined, and the older step restored instead; a receiver whose disk
is full fails at once and drains its sender, and the pair stays usable."""

from __future__ import annotations

import functools
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.corruptions import CORRUPTIONS, RUN, SPEC, STATE, publish_step
from tests.helpers import TEST_KEY, flip_byte, two_gloo_ranks
from tiering.collective import SingleProcess, TorchCollective
from tiering.errors import VerificationError
from tiering.local.posix import primary_store, replica_store
from tiering.local.publish import PosixStepPublisher, manifest_for, publish_received
from tiering.manifest import MANIFEST_NAME
from tiering.peer.replication import PeerReplicator
from tiering.peer.restore import PeerRecovery
from tiering.peer.transport import SEND_SLOTS, OutgoingStep, Transport
from tiering.system.fsio import write_file_durably

CHUNK = SPEC.chunk_bytes
PIECE = 4 * CHUNK  # 256 KiB messages: a 3 MiB file is 12 pieces through 3 send buffers
SIZES = {"empty.bin": 0, "one.bin": 1, "short.bin": CHUNK - 1, "exact.bin": CHUNK, "over.bin": CHUNK + 1}
SIZES |= {"nested/dir/big.bin": 3 * 1024 * 1024 + 7, "piece.bin": PIECE}
BYTE_DAMAGE = ("chunk flipped in the middle", "truncated last chunk")
TOPOLOGY = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2}


def _files(owner: int, step: int) -> dict[str, bytes]:
    return {rel: random.Random(f"{owner}:{step}:{rel}").randbytes(size) for rel, size in SIZES.items()}


def _publish_files(node_root: Path, owner: int, step: int, replica: bool = False) -> Path:
    layout = (replica_store if replica else primary_store)(node_root, owner, RUN, 3).layout
    pub = PosixStepPublisher(layout, SingleProcess(), f"w{owner}", SPEC)
    tmp = pub.begin(step)
    known = {}
    for rel, data in _files(owner, step).items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        known[rel] = write_file_durably(tmp / rel, lambda fh, d=data: fh.write(d), SPEC)
    pub.commit(tmp, manifest_for(RUN, step, 2, {"tp": 1, "pp": 1, "dp": 2}, extra={"owner_rank": owner}), known=known)
    return layout.step_dir(step)


# -- scenarios, each run by both ranks ---------------------------------------------------------------
def _both_ways(rank: int, root: Path, group: Any) -> dict[str, Any]:
    """The real replicator on a ring of two: each rank sends its step and receives the other's."""
    node_root = root / f"node-{rank}"
    published = _publish_files(node_root, rank, 10)
    transport = Transport(group, 30, piece=PIECE, key=TEST_KEY)
    replicator = PeerReplicator(RUN, rank, {0: [1], 1: [0]}, node_root, transport, TorchCollective(group), 3, "a")
    report = replicator.replicate(10, published)
    peer = 1 - rank
    replica = replica_store(node_root, peer, RUN, 3).step_path(10)
    same = {rel: (replica / rel).read_bytes() == data for rel, data in _files(peer, 10).items()}
    leftovers = [p.name for p in replica.parent.iterdir() if ".tmp-" in p.name]
    return {"under": report.under_replicated, "failures": report.failures, "same": same, "leftovers": leftovers}


def _wire_corruptions(rank: int, root: Path, group: Any) -> dict[str, Any]:
    """Rank 0 sends each damaged copy (bytes on disk, or the manifest it puts on the wire)."""
    transport = Transport(group, 30, piece=PIECE, key=TEST_KEY)
    out: dict[str, Any] = {}
    good = publish_step(primary_store(root / "sender", 1, RUN, 3).layout, 20, owner=1) if rank == 0 else None
    for n, name in enumerate(CORRUPTIONS):
        payload = None
        if rank == 0:
            assert good is not None
            damaged = root / f"damaged-{n}" / good.name
            shutil.copytree(good, damaged)
            CORRUPTIONS[name][0](damaged)
            # Damaged bytes are read from the damaged copy; a damaged manifest is what goes on the wire.
            payload = OutgoingStep.of(damaged if name in BYTE_DAMAGE else good, _head(20))
            payload.manifest_raw = (damaged / MANIFEST_NAME).read_bytes()
            transport.exchange({1: payload}, {})
            continue
        layout = replica_store(root / "receiver", 1, RUN, 3).layout
        received, errors = transport.exchange({}, {0: layout.tmp_dir(20, f"c{n}")})
        try:
            publish_received(layout, received[0], RUN, 20, 1)
            out[name] = "committed"
        except VerificationError as exc:
            out[name] = str(exc)
        out[name + ":left"] = sorted(p.name for p in layout.steps_dir.iterdir()) if layout.steps_dir.exists() else []
    return out


def _head(step: int) -> dict[str, Any]:
    return {"run_id": RUN, "step": step, "owner": 1, "kind": "replica"}


def _bad_served_copy(rank: int, root: Path, group: Any) -> dict[str, Any]:
    """Node 0 holds rank 1's replicas of steps 10 and 20 (20 damaged); node 1's disk is empty."""
    node_root = root / f"node-{rank}"
    coll = TorchCollective(group)
    if rank == 0:
        for step in (10, 20):
            _publish_files(node_root, 0, step)
            _publish_files(node_root, 1, step, replica=True)
        flip_byte(replica_store(node_root, 1, RUN, 3).step_path(20) / "nested/dir/big.bin")
    coll.barrier()
    transport = Transport(group, 30, piece=PIECE, key=TEST_KEY)
    result = PeerRecovery(RUN, rank, 2, f"node-{rank}", node_root, coll, transport, TOPOLOGY, 3, "r").recover()
    got = result.restore
    out: dict[str, Any] = {"step": got.step if got else None, "tier": got.tier if got else None}
    out["rejected"] = result.rejected
    if rank == 1 and got is not None:
        out["bytes_ok"] = all((got.path / rel).read_bytes() == data for rel, data in _files(1, 10).items())
    quarantine = replica_store(root / "node-0", 1, RUN, 3).layout.quarantine_dir
    out["quarantined"] = sorted(p.name for p in quarantine.iterdir()) if quarantine.exists() else []
    return out


def _full_disk(rank: int, root: Path, group: Any) -> dict[str, Any]:
    """Rank 1 receives onto a 1 MiB tmpfs (``root/tiny``): it cannot reserve 3 MiB."""
    transport = Transport(group, 60, piece=PIECE, key=TEST_KEY)
    node_root = root / "node-0"
    published = _publish_files(node_root, 1, 10) if rank == 0 else None
    out: dict[str, Any] = {}
    for attempt, where in (("full", root / "tiny" / "r"), ("fine", root / "disk" / "r")):
        t0 = time.perf_counter()
        if rank == 0:
            assert published is not None
            _, errors = transport.exchange({1: OutgoingStep.of(published, _head(10))}, {})
            out[attempt] = {"sender_errors": errors}
        else:
            received, errors = transport.exchange({}, {0: where / "steps" / "step-000000010.tmp-x"})
            out[attempt] = {"errors": errors, "received": sorted(received)}
            out[attempt]["left"] = where.exists() and any(where.rglob("*.bin"))
        out[attempt]["seconds"] = time.perf_counter() - t0
    return out


SCENARIOS: dict[str, Callable[[int, Path, Any], dict[str, Any]]] = {
    "both_ways": _both_ways,
    "wire_corruptions": _wire_corruptions,
    "bad_served_copy": _bad_served_copy,
    "full_disk": _full_disk,
}


def _scenario(scenario: str, rank: int, root: Path) -> dict[str, Any]:
    return SCENARIOS[scenario](rank, root, dist.group.WORLD)


def _run(scenario: str, root: Path) -> tuple[dict[str, Any], ...]:
    return two_gloo_ranks(functools.partial(_scenario, scenario), root)


# -- tests ------------------------------------------------------------------------------------------
def test_steps_stream_both_ways_and_arrive_identical(tmp_path: Path) -> None:
    assert len(range(0, SIZES["nested/dir/big.bin"], PIECE)) > 3 * SEND_SLOTS, "every send buffer is reused"
    for rank, row in enumerate(_run("both_ways", tmp_path)):
        assert row["under"] == [] and row["failures"] == {}, row
        assert all(row["same"].values()) and set(row["same"]) == set(SIZES), f"rank {rank}: {row['same']}"
        assert row["leftovers"] == [], "nothing temporary is left once the replica is committed"


def test_every_corruption_on_the_wire_is_rejected_and_never_committed(tmp_path: Path) -> None:
    _, got = _run("wire_corruptions", tmp_path)
    for name, (_, needle) in CORRUPTIONS.items():
        if name == "truncated last chunk":
            needle = "the sender could not read it"  # told by the sender: the tail it sent is not the file
        assert needle in got[name] and "\n" not in got[name], (name, got[name])
        assert got[name + ":left"] == [], f"{name}: nothing published, nothing temporary left"
    assert STATE in got["chunk flipped in the middle"], "the file is named"


def test_a_bad_copy_served_for_a_restore_is_quarantined_and_the_older_step_used(tmp_path: Path) -> None:
    sender, receiver = _run("bad_served_copy", tmp_path)
    assert (receiver["step"], receiver["tier"]) == (10, "peer") and receiver["bytes_ok"], receiver
    assert (sender["step"], sender["tier"]) == (10, "local"), sender
    rejected = receiver["rejected"]
    assert len(rejected) == 1 and "big.bin: chunk " in rejected[0] and "does not match" in rejected[0], rejected
    assert any(name.startswith("step-000000020") for name in sender["quarantined"]), sender["quarantined"]


def test_a_receiver_with_a_full_disk_fails_at_once_and_the_pair_stays_usable(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {tiny} 2>/dev/null") != 0:
        pytest.skip("needs root to mount a small tmpfs as a full disk")
    try:
        sender, receiver = _run("full_disk", tmp_path)
    finally:
        os.system(f"umount {tiny}")
    full = receiver["full"]
    assert full["received"] == [] and "No space left on device" in full["errors"]["0"], full
    assert not full["left"], "nothing of the copy is left on the full disk"
    assert sender["full"]["sender_errors"] == {} and sender["full"]["seconds"] < 20, "the sender was drained"
    assert receiver["fine"]["received"] == [0] and receiver["fine"]["errors"] == {}, receiver["fine"]
