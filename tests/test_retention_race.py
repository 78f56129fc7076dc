"""Tier-1 retention is decided after the global save outcome: while saves commit on this rank but
fail on another (a commit that hit EIO or a full disk there), this rank deletes none of its steps,
so the newest step every rank has committed survives; once a step commits everywhere, retention
resumes with ``keep``. ``make_room`` keeps that step too, and it hashes before it trusts: a newer
step whose bytes are torn does not stand in for an intact older one.

In one process, through the real per-rank tier (``build_per_rank_checkpoints``) and its publish
path; the other rank is a collective that reports that rank's failed commit for chosen steps."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pretrain.checkpointing.per_rank_assembly import build_per_rank_checkpoints
from tests.test_restore_selection import _cfg, _state, _train_to
from tiering.collective import SingleProcess
from tiering.errors import PublishError
from tiering.local.posix import QUARANTINE_KEEP_S, PosixTier
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.peer.transport import Transport
from tiering.trust.run_key import RunKey


class _PeerCommitFails(SingleProcess):
    """This rank, plus what rank 1 reports while ``failing``: its write went fine (the first
    outcome a synchronous save gathers), its commit failed (the second: the global outcome)."""

    def __init__(self) -> None:
        self.failing = False
        self._outcomes = 0

    def all_gather(self, obj: Any) -> list[Any]:
        if obj is None or isinstance(obj, str):
            self._outcomes += 1
            if self.failing and self._outcomes % 2 == 0:
                return [obj, "commit failed: [Errno 5] Input/output error (rank 1)"]
            return [obj, None]
        return [obj]


def test_the_newest_step_every_rank_committed_survives_failed_saves_elsewhere(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "checkpoint.local.keep=2", "checkpoint.async.enabled=false")
    coll = _PeerCommitFails()
    transport = Transport(None, 30, key=RunKey.generate())
    tiers = build_per_rank_checkpoints(cfg, coll, "a0", {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}, transport, coll)
    tiers.prepare()
    state = _state(cfg)
    for step in (10, 20):
        _train_to(state, step)
        tiers.save(state)
    assert tiers.store.committed_steps() == [20, 10] and tiers.complete_step == 20
    coll.failing = True
    for step in (30, 40, 50):
        _train_to(state, step)
        try:
            tiers.save(state)
        except PublishError as exc:
            assert "rank 1" in str(exc) and "\n" not in str(exc), exc
    committed = tiers.store.committed_steps()
    assert committed[:3] == [50, 40, 30], f"this rank committed its saves: {committed}"
    assert 20 in committed and tiers.complete_step == 20, "the newest step every rank has survives"
    assert tiers.store.make_room({20}) and 20 in tiers.store.committed_steps(), "make_room keeps it too"
    coll.failing = False
    _train_to(state, 60)
    tiers.save(state)
    assert tiers.store.committed_steps() == [60, 50] and tiers.complete_step == 60, "keep=2 once 60 is everywhere"


def test_make_room_keeps_the_newest_step_whose_bytes_verify(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path, "r", keep=3)
    for step in (10, 20, 30):
        pub = PosixStepPublisher(tier.layout, SingleProcess(), f"w{step}")
        tmp = pub.begin(step)
        (tmp / "state.pt").write_bytes(bytes([step]) * 4096)
        pub.commit(tmp, manifest_for("r", step, 1, {"tp": 1}))
    torn = tier.step_path(30) / "state.pt"
    torn.write_bytes(b"\0" * 4096)  # its manifest still reads: only hashing tells
    assert tier.make_room() == [10]
    assert tier.committed_steps() == [30, 20], "the intact step 20 is kept beside the torn newest"


def test_quarantined_steps_are_reclaimed_after_the_bounded_time_and_first_when_the_disk_is_full(
    tmp_path: Path,
) -> None:
    tier = PosixTier(tmp_path, "r", keep=3)
    for step in (10, 20, 30):
        pub = PosixStepPublisher(tier.layout, SingleProcess(), f"w{step}")
        tmp = pub.begin(step)
        (tmp / "state.pt").write_bytes(bytes([step]) * 4096)
        pub.commit(tmp, manifest_for("r", step, 1, {"tp": 1}))
    old, fresh = tier.quarantine(10, "bad bytes"), tier.quarantine(20, "bad bytes")
    assert old is not None and fresh is not None
    aged = time.time() - QUARANTINE_KEEP_S - 60
    os.utime(old.with_name(old.name + ".reason.txt"), (aged, aged))
    tier.apply_retention()
    assert not old.exists() and fresh.exists(), "only what was quarantined longer than the bound is reclaimed"
    tier.make_room()
    assert not fresh.exists() and tier.committed_steps() == [30], "a full volume drops quarantine first"
