"""A tier reads only its own digest: a reshardable-tier step whose manifest chose xxh3-128 (not a
defence against forgery) for itself is refused in one line before anything is hashed, and the
older blake3 step is chosen; a suspect step is skipped by the staging restore."""

from __future__ import annotations

from pathlib import Path

from tiering.collective import SingleProcess
from tiering.digest import PORTABLE_HASH, HashSpec
from tiering.local.posix import PosixTier
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.local.restore import select_newest_verified


def _publish(tier: PosixTier, step: int, hash_name: str) -> None:
    pub = PosixStepPublisher(tier.layout, SingleProcess(), f"w{step}", HashSpec(hash_name, 64 * 1024, 1))
    tmp = pub.begin(step)
    (tmp / "trainer.pt").write_bytes(bytes([step]) * 100_000)
    pub.commit(tmp, manifest_for("r", step, 1, {"tp": 1}))


def test_a_step_hashed_with_another_digest_than_the_tiers_is_refused(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path, "r", keep=3, expect_hash=PORTABLE_HASH)
    _publish(tier, 10, PORTABLE_HASH)
    _publish(tier, 20, "xxh3-128")
    selection = select_newest_verified(tier, SingleProcess())
    assert selection is not None and selection.step == 10
    [(step, reason)] = selection.rejected
    assert step == 20 and "trainer.pt is hashed with xxh3-128, this tier reads blake3 only" in reason, reason
    assert "\n" not in reason
    assert PosixTier(tmp_path, "r").verify(10).step == 10, "a tier without a required digest reads any known one"


def test_a_suspect_step_is_never_chosen_by_a_staging_restore_nor_quarantined(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path, "r", keep=3, expect_hash=PORTABLE_HASH)
    for step in (10, 20):
        _publish(tier, step, PORTABLE_HASH)
    selection = select_newest_verified(tier, SingleProcess(), exclude=frozenset({20}))
    assert selection is not None and selection.step == 10 and selection.rejected == []
    assert tier.step_dirs() == [20, 10], "the suspect stays where it is (evidence), it is only skipped"
