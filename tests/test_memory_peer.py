"""Tier 0's peer copy between two real gloo processes (each its own 'node': its own tier-0 root
under this test's directory): each sealed slot streamed to the peer arrives byte-identical and
sealed under the owner's manifest, at most ``slots`` copies per owner; a stream that falls behind
sends the newest slot and counts the ones it skipped, on its own group; after the loss of a node
its rank restores from the peer's copy (fetched, checked, sealed as its own slot) bit for bit; a
flipped byte in the peer copy is caught by its chunk digest and quarantined, and a copy that was
never sealed (a receive cut short) is never used: the ranks agree on the older step instead."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pretrain.checkpointing.memory_tier import MemoryTier
from pretrain.config import load_config
from tests.helpers import TEST_KEY, TINY, flip_byte, two_gloo_ranks
from tiering.collective import TorchCollective
from tiering.digest import HashSpec
from tiering.manifest import Manifest
from tiering.memory.peer_slots import Offer, PeerStream
from tiering.memory.slot_store import SlotStore
from tiering.peer.transport import Transport
from tiering.verify import verify_step

HASHING = HashSpec(chunk_bytes=64 * 1024)  # several chunks per slot
TOPOLOGY = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2}


def _tier(rank: int, root: Path) -> MemoryTier:
    """Rank ``rank``'s tier 0 on its own node's root, its peer copy going to the other rank."""
    node = root / f"node-{rank}"
    cfg = load_config(TINY, ["run.id=r", f"checkpoint.memory.dir={node}", "checkpoint.memory.enabled=true"])
    tier = MemoryTier(cfg, TorchCollective(), "a1", TOPOLOGY)
    tier.attach_peers({0: [1], 1: [0]}, Transport(dist.group.WORLD, 20, piece=4 * HASHING.chunk_bytes, key=TEST_KEY))
    return tier


def _seal(store: SlotStore, slot: int, step: int, sequence: int) -> Offer:
    """A slot as tier 0 seals it: rank-specific bytes, the owner's manifest (owner_rank in extra)."""
    payload = {"w": torch.full((96, 1024), float(step * 10 + store.rank)), "step": step}
    store.write_payload(slot, lambda fh: torch.save(payload, fh), fresh_inode=False)
    manifest = Manifest("r", step, 2, {"tp": 1, "pp": 1, "dp": 2}, [], extra={"owner_rank": store.rank})
    store.seal(slot, manifest, store.digest(slot, HASHING), sequence)
    return Offer(step, slot, sequence)


def _stream(tier: MemoryTier, offers: list[Offer]) -> int:
    """Offer every slot before the stream thread starts (it starts behind), drain; skipped."""
    assert tier.peers is not None
    stream = PeerStream(tier.peers)
    for offer in offers:
        stream.offer(offer)
    assert stream.start().close(drain=True, timeout=60)
    return stream.skipped_total


# -- scenarios, each run by both ranks -----------------------------------------------------------
def _streaming(rank: int, root: Path) -> dict[str, Any]:
    tier = _tier(rank, root)
    assert tier.peers is not None
    first = _seal(tier.store, 0, 1, 1)
    behind = _stream(tier, [first])  # one offer, one round: sent
    offers = [_seal(tier.store, 1, 2, 2), _seal(tier.store, 0, 3, 3)]
    skipped = _stream(tier, offers)  # two offers owed when the thread starts: the newest goes
    other = tier.peers.held[1 - rank]
    sealed = [v for v in other.views() if v.step is not None]
    newest = max(sealed, key=lambda v: v.step or 0)
    verify_step(other.slot_dir(newest.index), expect_run_id="r")
    theirs = SlotStore(root / f"node-{1 - rank}", "r", 1 - rank, 2).state_path(0)  # step 3, at the owner
    return {
        "skipped": [behind, skipped],
        "held_steps": sorted(v.step for v in sealed),
        "slot_dirs": sorted(p.name for p in other.rank_dir.iterdir()),
        "same_bytes": other.state_path(newest.index).read_bytes() == theirs.read_bytes(),
    }


def _node_loss(rank: int, root: Path, damage: str) -> dict[str, Any]:
    """Steps 5 and 6 sealed and streamed; rank 1's node is lost (its own slots gone); rank 0's copy
    of rank 1's step 6 is damaged as ``damage`` says (or not); both ranks restore from tier 0."""
    tier = _tier(rank, root)
    assert tier.peers is not None
    offers = [_seal(tier.store, 0, 5, 1), _seal(tier.store, 1, 6, 2)]
    originals = {o.step: tier.store.state_path(o.slot).read_bytes() for o in offers}
    for offer in offers:
        _stream(tier, [offer])
    dist.barrier()
    if rank == 1:
        shutil.rmtree(tier.store.rank_dir)  # the node is gone: the replacement's tmpfs is empty
    held = tier.peers.held[1 - rank]
    six = next(v.index for v in held.views() if v.step == 6)
    if rank == 0 and damage == "flipped":
        flip_byte(held.state_path(six))
    if rank == 0 and damage == "unsealed":  # a receive killed mid-way: unsealed, half the bytes
        held.invalidate(six)
        os.truncate(held.state_path(six), held.state_path(six).stat().st_size // 2)
    dist.barrier()
    found, rejected = tier.find_restorable(-1, set())
    assert found is not None
    return {
        "found": [found.step, found.tier, found.holder],
        "rejected": rejected,
        "bit_exact": tier.store.state_path(found.slot).read_bytes() == originals[found.step],
        "quarantined": sorted(p.name for p in held.quarantine_dir.iterdir()) if held.quarantine_dir.is_dir() else [],
    }


SCENARIOS = {
    "streaming": _streaming,
    "intact": lambda r, root: _node_loss(r, root, "none"),
    "flipped": lambda r, root: _node_loss(r, root, "flipped"),
    "unsealed": lambda r, root: _node_loss(r, root, "unsealed"),
}


def _scenario(scenario: str, rank: int, root: Path) -> dict[str, Any]:
    return SCENARIOS[scenario](rank, root)


def _run(scenario: str, root: Path) -> tuple[dict[str, Any], ...]:
    return two_gloo_ranks(functools.partial(_scenario, scenario), root)


def test_sealed_slots_reach_the_peer_sealed_and_a_stream_behind_sends_the_newest(tmp_path: Path) -> None:
    for rank, got in enumerate(_run("streaming", tmp_path)):
        assert got["skipped"] == [0, 1], got  # offers 2 and 3 owed at once: 2 skipped, 3 sent
        assert got["held_steps"] == [1, 3] and got["slot_dirs"] == ["slot-0", "slot-1"], (rank, got)
        assert got["same_bytes"], "the peer copy must be the owner's bytes"


def test_after_a_node_loss_its_rank_restores_bit_exact_from_the_peers_tier0(tmp_path: Path) -> None:
    survivor, replaced = _run("intact", tmp_path)
    assert survivor["found"] == [6, "memory", None] and survivor["bit_exact"]
    assert replaced["found"] == [6, "memory-peer", 0] and replaced["bit_exact"], replaced
    assert survivor["rejected"] == replaced["rejected"] == []


@pytest.mark.parametrize("damage", ["flipped", "unsealed"])
def test_a_bad_or_unsealed_peer_copy_is_never_used_the_older_step_is(tmp_path: Path, damage: str) -> None:
    survivor, replaced = _run(damage, tmp_path)
    assert survivor["found"] == [5, "memory", None] and replaced["found"] == [5, "memory-peer", 0]
    assert replaced["bit_exact"] and survivor["bit_exact"]
    if damage == "flipped":  # caught by its chunk digest while read, quarantined where it was held
        assert survivor["quarantined"] == ["slot-1"] or survivor["quarantined"] == ["slot-0"], survivor
        assert [s for s, _ in replaced["rejected"]] == [6] and "chunk" in replaced["rejected"][0][1], replaced
    else:  # never sealed: not even a candidate
        assert survivor["quarantined"] == [] and replaced["rejected"] == []
