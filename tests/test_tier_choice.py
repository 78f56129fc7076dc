"""Which tier a restore takes, in one process: ``TieredCheckpointer`` on a one-rank gloo group (the
group its replication and peer stream need; a rank alone sends nothing) with tier 0 on a tmp
directory and tier 1 on real files. The newest verified step wins across tiers; tier 0 is used only
when it holds tier 1's newest step or a newer one; a flipped byte in both tier-0 slots, or a suspect
step, sends the restore to the next good source, and what was passed over is named. The
multi-process tests keep the end-to-end proofs (test_memory_tier: kills during the slot write,
test_cluster_memory_peer: node loss)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pretrain.checkpointing.state import RestoreResult
from pretrain.checkpointing.tiered import TieredCheckpointer
from pretrain.config import Config
from tests.test_restore_selection import TOPOLOGY, _assert_same, _cfg, _flip_a_byte, _state, _train_to, _weights
from tiering.collective import TorchCollective
from tiering.memory.slot_store import SlotStore
from tiering.memory.slots import SlotState


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _config(tmp: Path, memory_interval: int = 1) -> Config:
    return _cfg(
        tmp,
        "checkpoint.reshardable.enabled=false",
        "checkpoint.async.enabled=false",
        "checkpoint.memory.enabled=true",
        f"checkpoint.memory.dir={tmp / 'shm'}",
        f"checkpoint.memory.interval={memory_interval}",
    )


def _tiers(cfg: Config, attempt: str) -> TieredCheckpointer:
    tiers = TieredCheckpointer(cfg, TorchCollective(None), attempt, dict(TOPOLOGY))
    tiers.prepare()
    return tiers


def _train(cfg: Config, steps: range, local_every: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every step its tier-0 snapshot (at tier 0's interval), tier 1 every ``local_every`` steps."""
    tiers, state, weights = _tiers(cfg, "a0"), _state(cfg), {}
    assert tiers.memory is not None and tiers.local is not None
    for step in steps:
        _train_to(state, step)
        weights[step] = _weights(state)
        if tiers.memory.due(step, final=False):
            tiers.memory.save(state)
        if step % local_every == 0:
            tiers.local.save(state)
    return weights


def _restore(cfg: Config) -> tuple[RestoreResult | None, dict[str, torch.Tensor]]:
    state = _state(cfg)
    result = _tiers(cfg, "a1").restore(state)
    return result, _weights(state)


def _sealed_slots(cfg: Config) -> SlotStore:
    return SlotStore(Path(cfg.checkpoint.memory.dir), cfg.run.id, 0, cfg.checkpoint.memory.slots)


def test_tier0_newer_than_tier1_is_restored_bit_exact(tmp_path: Path, one_rank_group: None) -> None:
    cfg = _config(tmp_path)
    weights = _train(cfg, range(1, 13), local_every=5)
    result, got = _restore(cfg)
    assert result is not None and (result.tier, result.step) == ("memory", 12), result
    assert "tier 1's newest was 10" in result.notes[0], result.notes
    _assert_same(got, weights[12])


def test_tier0_older_than_tier1_is_never_used(tmp_path: Path, one_rank_group: None) -> None:
    cfg = _config(tmp_path, memory_interval=4)  # tier 0 at 4, 8, 12; tier 1 at 13
    weights = _train(cfg, range(1, 14), local_every=13)
    result, got = _restore(cfg)
    assert result is not None and (result.tier, result.step) == ("local", 13), result
    _assert_same(got, weights[13])


def test_both_tier0_slots_flipped_fall_back_to_tier1_and_are_named(tmp_path: Path, one_rank_group: None) -> None:
    cfg = _config(tmp_path)
    weights = _train(cfg, range(1, 13), local_every=5)
    store = _sealed_slots(cfg)
    sealed = [v for v in store.views() if v.state is SlotState.SEALED]
    assert sorted(v.step for v in sealed) == [11, 12]
    for view in sealed:
        _flip_a_byte(store.state_path(view.index))
    result, got = _restore(cfg)
    assert result is not None and (result.tier, result.step) == ("local", 10), result
    assert sorted(step for step, _ in result.rejected if step in (11, 12)) == [11, 12], result.rejected
    _assert_same(got, weights[10])


def test_a_suspect_step_in_tier0_is_passed_over_for_the_older_slot(tmp_path: Path, one_rank_group: None) -> None:
    cfg = _config(tmp_path)
    weights = _train(cfg, range(1, 13), local_every=5)
    tiers = _tiers(cfg, "a1")
    tiers.quarantine_everywhere(12, "loss spike at step 12")
    state = _state(cfg)
    result = tiers.restore(state)
    assert result is not None and (result.tier, result.step) == ("memory", 11), result
    _assert_same(_weights(state), weights[11])
