"""Tier-0 slots in process: the rotation and sealing policy (tables), and real slot files on a
tmpfs: a torn or unsealed slot is never loaded, a flipped byte is caught by its chunk digest and
quarantined, another run's or an older-than-tier-1 slot is skipped, a full tmpfs leaves nothing."""

from __future__ import annotations

import errno
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.memory_tier import MemoryTier
from pretrain.checkpointing.rank_payload import load_verified_state
from pretrain.config import load_config, validate
from pretrain.errors import ConfigError
from tests.helpers import TINY, flip_byte, tmpfs
from tiering.collective import SingleProcess
from tiering.commands.main import main as cli_main
from tiering.digest import HashSpec
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, Manifest
from tiering.memory.slot_store import SlotStore
from tiering.memory.slots import SlotState, SlotView, common_step, loadable, newer_than, next_sequence, slot_to_write

S = SlotView.sealed
U = SlotView.unsealed
E = SlotView.empty
HASHING = HashSpec(chunk_bytes=64 * 1024)  # several chunks per test payload


# -- the policy ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([E(0), E(1)], 0),
        ([S(0, "r", 5, 5), E(1)], 1),
        ([S(0, "r", 5, 5), U(1)], 1),
        ([U(0), S(1, "r", 5, 5)], 0),
        ([S(0, "r", 6, 6), S(1, "r", 5, 5)], 1),  # the older sequence; never the newest sealed
        ([S(0, "r", 5, 7), S(1, "r", 6, 6)], 1),  # sequence, not step, decides (a rewound timeline)
        ([S(0, "other", 9, 9), S(1, "r", 5, 5)], 0),  # another run's slot goes first
        ([S(0, "r", 1, 1), S(1, "r", 2, 2), S(2, "r", 3, 3)], 0),
        ([S(0, "r", 1, 4), U(1), S(2, "r", 3, 3)], 1),
    ],
)
def test_slot_to_write_never_picks_the_newest_sealed_slot(views: list[SlotView], expected: int) -> None:
    assert slot_to_write(views, "r") == expected


@pytest.mark.parametrize(
    ("views", "pinned", "expected"),
    [
        # three slots: the one being sent to the peer is passed over, the newest is still kept
        ([S(0, "r", 1, 1), S(1, "r", 2, 2), S(2, "r", 3, 3)], {0}, 1),
        ([S(0, "r", 4, 4), S(1, "r", 2, 2), S(2, "r", 3, 3)], {1}, 2),
        ([U(0), S(1, "r", 2, 2), S(2, "r", 3, 3)], {0}, 1),
        # two slots, the older one pinned: the newest is never the one written, the pin gives way
        ([S(0, "r", 1, 1), S(1, "r", 2, 2)], {0}, 0),
        ([S(0, "r", 2, 2), U(1)], {1}, 1),
        # a pin on the newest changes nothing (it is never written anyway)
        ([S(0, "r", 1, 1), S(1, "r", 2, 2), S(2, "r", 3, 3)], {2}, 0),
    ],
)
def test_a_slot_the_peer_stream_is_sending_is_written_only_when_no_other_qualifies(
    views: list[SlotView], pinned: set[int], expected: int
) -> None:
    assert slot_to_write(views, "r", pinned) == expected


def test_slot_to_write_refuses_fewer_than_two_slots() -> None:
    with pytest.raises(ValueError, match="at least 2 slots"):
        slot_to_write([E(0)], "r")


@pytest.mark.parametrize(
    ("views", "expected"),
    [([E(0), E(1)], 1), ([S(0, "r", 5, 9), U(1)], 10), ([S(0, "x", 1, 3), S(1, "r", 2, 2)], 4)],
)
def test_next_sequence_only_grows(views: list[SlotView], expected: int) -> None:
    assert next_sequence(views) == expected


@pytest.mark.parametrize(
    ("views", "floor", "suspect", "steps"),
    [
        ([S(0, "r", 6, 6), S(1, "r", 5, 5)], -1, (), [6, 5]),
        ([S(0, "r", 6, 6), U(1)], -1, (), [6]),  # an unsealed slot is never loadable
        ([S(0, "x", 9, 9), S(1, "r", 5, 5)], -1, (), [5]),  # another run's slot is not used
        ([S(0, "r", 6, 6), S(1, "r", 5, 5)], 6, (), [6]),  # older than tier 1: not used
        ([S(0, "r", 6, 6), S(1, "r", 5, 5)], 7, (), []),
        ([S(0, "r", 6, 6), S(1, "r", 5, 5)], -1, (6,), [5]),  # a suspect step is never restored
        ([E(0), E(1)], -1, (), []),
    ],
)
def test_loadable_slots_newest_first(
    views: list[SlotView], floor: int, suspect: tuple[int, ...], steps: list[int]
) -> None:
    assert [v.step for v in loadable(views, "r", floor, suspect)] == steps


def test_newer_than_names_the_abandoned_timeline() -> None:
    assert newer_than([S(0, "r", 8, 8), S(1, "r", 7, 7), S(2, "x", 9, 9)], "r", 7) == [0]


@pytest.mark.parametrize(
    ("per_rank", "expected"),
    [([[6, 5], [6, 5]], 6), ([[6, 5], [5, 4]], 5), ([[6], [5]], None), ([[6, 5], []], None), ([], None)],
)
def test_common_step_is_the_newest_every_rank_holds(per_rank: list[list[int]], expected: int | None) -> None:
    assert common_step(per_rank) == expected


# -- real slot files ---------------------------------------------------------------------------------
def _payload(value: float) -> dict[str, object]:
    return {"w": torch.full((64, 1024), value), "step": int(value)}


def _write_sealed(store: SlotStore, slot: int, step: int, sequence: int, run_id: str = "r") -> None:
    store.write_payload(slot, lambda fh: torch.save(_payload(float(step)), fh), fresh_inode=False)
    manifest = Manifest(run_id, step, 1, {"tp": 1, "pp": 1, "dp": 1}, [])
    store.seal(slot, manifest, store.digest(slot, HASHING), sequence)


def test_a_sealed_slot_verifies_and_loads_what_was_written(shm_root: Path) -> None:
    store = SlotStore(shm_root, "r", 0, 2)
    _write_sealed(store, 0, 7, 1)
    assert store.views() == [S(0, "r", 7, 1), E(1)]
    manifest = store.verify(0, threads=2)
    assert manifest.step == 7 and manifest.files[0].bytes == store.state_path(0).stat().st_size
    assert len(manifest.files[0].chunks) > 1
    loaded = load_verified_state(store.state_path(0))
    assert torch.equal(loaded["w"], torch.full((64, 1024), 7.0))


def test_writing_a_slot_unseals_it_before_any_payload_byte_changes(shm_root: Path) -> None:
    store = SlotStore(shm_root, "r", 0, 2)
    _write_sealed(store, 0, 7, 1)
    seen: list[SlotView] = []

    def write(fh: io.RawIOBase) -> None:
        seen.append(store.view(0))  # what a reader sees while the payload is being written
        torch.save(_payload(9.0), fh)

    store.write_payload(0, write, fresh_inode=False)
    assert seen == [U(0)] and store.view(0) == U(0)
    assert not (store.slot_dir(0) / COMMITTED_NAME).exists()
    assert not (store.slot_dir(0) / MANIFEST_NAME).exists()


def test_an_in_place_rewrite_shrinks_the_file_to_the_new_payload(shm_root: Path) -> None:
    store = SlotStore(shm_root, "r", 0, 2)
    store.write_payload(0, lambda fh: torch.save({"w": torch.zeros(100_000)}, fh), fresh_inode=False)
    size = store.write_payload(0, lambda fh: torch.save({"w": torch.ones(10)}, fh), fresh_inode=False)
    assert store.state_path(0).stat().st_size == size < 100_000
    assert torch.equal(torch.load(store.state_path(0))["w"], torch.ones(10))


def test_a_fresh_inode_leaves_a_mapped_state_untouched(shm_root: Path) -> None:
    store = SlotStore(shm_root, "r", 0, 2)
    _write_sealed(store, 0, 3, 1)
    mapped = load_verified_state(store.state_path(0))
    store.write_payload(0, lambda fh: torch.save(_payload(4.0), fh), fresh_inode=True)
    assert torch.equal(mapped["w"], torch.full((64, 1024), 3.0))


@pytest.fixture
def memory_tier(shm_root: Path) -> MemoryTier:
    cfg = load_config(TINY, ["run.id=r", f"checkpoint.memory.dir={shm_root}", "checkpoint.memory.enabled=true"])
    return MemoryTier(cfg, SingleProcess(), "a1", {"world_size": 1, "tp": 1, "pp": 1, "dp": 1})


def test_a_torn_slot_is_never_loaded_the_other_slot_is(memory_tier: MemoryTier) -> None:
    store = memory_tier.store
    _write_sealed(store, 0, 5, 1)
    _write_sealed(store, 1, 6, 2)
    # A kill mid-write: the header was invalidated, half the payload written, no seal.
    store.write_payload(1, lambda fh: fh.write(b"\0" * 1000), fresh_inode=False)
    found, rejected = memory_tier.find_restorable(-1, set())
    assert found is not None and (found.step, found.slot, found.tier) == (5, 0, "memory") and rejected == []


def test_a_flipped_byte_in_a_sealed_slot_is_caught_quarantined_and_the_older_slot_used(
    memory_tier: MemoryTier,
) -> None:
    store = memory_tier.store
    _write_sealed(store, 0, 5, 1)
    _write_sealed(store, 1, 6, 2)
    flip_byte(store.state_path(1))
    found, rejected = memory_tier.find_restorable(-1, set())
    assert found is not None and (found.step, found.slot) == (5, 0)
    assert len(rejected) == 1 and rejected[0][0] == 6 and "does not match manifest" in rejected[0][1]
    assert "chunk" in rejected[0][1]
    assert (store.quarantine_dir / "slot-1" / "REASON").read_text().strip() == rejected[0][1].split(": ", 2)[2]
    assert store.view(1) == E(1)  # the next write goes there


def test_both_slots_bad_gives_no_tier0_step(memory_tier: MemoryTier) -> None:
    store = memory_tier.store
    _write_sealed(store, 0, 5, 1)
    _write_sealed(store, 1, 6, 2)
    flip_byte(store.state_path(0))
    flip_byte(store.state_path(1))
    found, rejected = memory_tier.find_restorable(-1, set())
    assert found is None and [s for s, _ in rejected] == [6, 5]


def test_slots_of_another_run_or_older_than_tier1_are_not_used(memory_tier: MemoryTier) -> None:
    store = memory_tier.store
    _write_sealed(store, 0, 9, 3, run_id="someone-else")
    _write_sealed(store, 1, 6, 2)
    found = memory_tier.find_restorable(-1, set())[0]
    assert found is not None and (found.step, found.slot) == (6, 1)
    assert memory_tier.find_restorable(7, set())[0] is None  # tier 1 holds step 7: newest wins


def test_a_slot_saved_at_another_topology_is_refused_not_quarantined(shm_root: Path) -> None:
    cfg = load_config(TINY, ["run.id=r", f"checkpoint.memory.dir={shm_root}", "checkpoint.memory.enabled=true"])
    tier = MemoryTier(cfg, SingleProcess(), "a1", {"world_size": 1, "tp": 2, "pp": 1, "dp": 1})
    _write_sealed(tier.store, 0, 5, 1)
    found, rejected = tier.find_restorable(-1, set())
    assert found is None and "another topology" in rejected[0][1]
    assert tier.store.view(0) == S(0, "r", 5, 1)


def test_invalidating_newer_slots_unseals_the_abandoned_timeline(memory_tier: MemoryTier) -> None:
    _write_sealed(memory_tier.store, 0, 5, 1)
    _write_sealed(memory_tier.store, 1, 6, 2)
    assert memory_tier.invalidate_newer(5) == [1]
    assert [v.state for v in memory_tier.store.views()] == [SlotState.SEALED, SlotState.UNSEALED]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for this test (root only), unmounted whatever happens."""
    with tmpfs(tmp_path / "tiny-shm", 1) as mnt:
        yield mnt


def test_a_full_tmpfs_fails_the_write_with_enospc_and_leaves_no_payload(small_tmpfs: Path) -> None:
    store = SlotStore(small_tmpfs, "r", 0, 2)
    with pytest.raises(OSError) as err:
        store.write_payload(0, lambda fh: torch.save({"w": torch.zeros(1 << 20)}, fh), fresh_inode=False)
    assert err.value.errno == errno.ENOSPC
    assert not store.state_path(0).exists() and store.view(0) == U(0)


def test_tiering_ls_and_verify_read_tier0_slots(memory_tier: MemoryTier, capsys: pytest.CaptureFixture[str]) -> None:
    store = memory_tier.store
    _write_sealed(store, 0, 5, 1)
    _write_sealed(store, 1, 6, 2)
    flip_byte(store.state_path(0))
    assert cli_main(["ls", str(store.root)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("0 ")]
    assert [r[:5] for r in rows] == [["0", "0", "sealed", "5", "1"], ["0", "1", "sealed", "6", "2"]]
    assert "NO:" in out.splitlines()[2] and out.splitlines()[3].endswith("yes")
    assert cli_main(["verify", str(store.slot_dir(1))]) == 0
    assert cli_main(["verify", str(store.slot_dir(0))]) == 1
    assert "does not match manifest" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [("slots", "1", "checkpoint.memory.slots"), ("interval", "0", "checkpoint.memory.interval")],
)
def test_bad_memory_tier_settings_are_refused_in_one_line(key: str, value: str, says: str) -> None:
    cfg = load_config(TINY, [f"checkpoint.memory.{key}={value}"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, cuda=False)
    assert says in str(err.value) and "fix:" in str(err.value) and "\n" not in str(err.value)
