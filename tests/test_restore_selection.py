"""Tiers 1-2 and tier 3 in one process, on real files: which copy a restore takes (own copy,
replica, a step saved at another topology, the object store), a corrupt or unfinished copy skipped
and quarantined, background publish and abandon, and retention.

``PerRankCheckpoints`` is built as a job builds it (``build_per_rank_checkpoints``) on
``SingleProcess`` and a real ``Transport`` (a rank with no peers sends nothing); its optimizer and
LR schedule are the trainer's own CPU ones. The model is a small ``torch.nn`` module: the tier only
saves and loads its ``state_dict``, and Megatron's GPTModel needs its process groups. A replica is
a committed step copied into the replica store byte for byte, which is what a verified transfer
from a peer leaves (the transfer itself is tested across real ranks in test_replication and
test_transport). The multi-process tests keep the end-to-end proofs (test_recovery_faults,
test_replication, test_async_save, test_retention).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.per_rank import PerRankCheckpoints
from pretrain.checkpointing.per_rank_assembly import build_per_rank_checkpoints
from pretrain.checkpointing.rank_payload import STATE_FILE
from pretrain.checkpointing.state import TrainingState
from pretrain.config import Config, load_config
from pretrain.data.sampler import GlobalBatchSampler
from pretrain.optim import CpuAdamW, build_scheduler
from tiering.collective import SingleProcess
from tiering.errors import PublishError
from tiering.layout import RunLayout
from tiering.local.posix import replica_store
from tiering.manifest import COMMITTED_NAME
from tiering.peer.transport import Transport
from tiering.remote.tier import RemoteTier
from tiering.trust.run_key import RunKey

TOPOLOGY = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}


def _cfg(tmp: Path, *settings: str) -> Config:
    return load_config(
        None,
        [
            f"run.dir={tmp / 'runs'}",
            "run.id=sel",
            f"checkpoint.local.dir={tmp / 'local'}",
            "checkpoint.local.keep=3",
            "checkpoint.replication.factor=1",
            "fault_tolerance.enabled=false",
            *settings,
        ],
    )


def _state(cfg: Config) -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = CpuAdamW(cfg.optimizer, model)
    sampler = GlobalBatchSampler(1000, cfg.data.global_batch_size, cfg.data.micro_batch_size, 0, 1, cfg.train.seed)
    return TrainingState(
        cfg,
        model,
        optimizer,
        build_scheduler(cfg.schedule, cfg.optimizer, cfg.train.steps, optimizer),
        sampler,
        dict(TOPOLOGY),
        "snap",
    )


def _tiers(cfg: Config, attempt: str = "a0", topology: dict[str, int] = TOPOLOGY) -> PerRankCheckpoints:
    # The real transport: a rank with no peers opens no connection.
    transport = Transport(None, cfg.checkpoint.replication.timeout_s, key=RunKey.generate())
    tiers = build_per_rank_checkpoints(cfg, SingleProcess(), attempt, dict(topology), transport, SingleProcess())
    tiers.prepare()
    return tiers


def _train_to(state: TrainingState, step: int) -> None:
    """Advance the counters and change every weight, so that each step's state is distinct."""
    state.step = step
    state.consumed_samples = step * state.cfg.data.global_batch_size
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(float(step))


def _weights(state: TrainingState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def _save(tiers: PerRankCheckpoints, state: TrainingState, step: int) -> dict[str, torch.Tensor]:
    _train_to(state, step)
    result = tiers.save(state)
    assert result.step == step and (result.path / COMMITTED_NAME).is_file()
    return _weights(state)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _copy_as_replica(tiers: PerRankCheckpoints, step: int) -> Path:
    """What a verified transfer from a peer leaves: the owner's committed step, byte for byte."""
    store = replica_store(tiers.node_root, 0, tiers.run_id, tiers.keep)
    dst = store.step_path(step)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiers.store.step_path(step), dst)
    return dst


def _restore_into_fresh_state(cfg: Config, tiers: PerRankCheckpoints) -> tuple[TrainingState, object]:
    plan = tiers.plan_restore()
    state = _state(cfg)
    if plan.restore is not None:
        tiers.load(plan.restore, state)
    return state, plan


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_newest_own_copy_is_restored_bit_exact_with_its_counters(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    at_20 = _save(tiers, state, 20)
    back, plan = _restore_into_fresh_state(cfg, _tiers(cfg, "a1"))
    assert plan.restore.step == 20 and plan.restore.tier == "local" and plan.rejected == []
    _assert_same(_weights(back), at_20)
    assert (back.step, back.consumed_samples) == (20, 20 * cfg.data.global_batch_size)


def test_a_corrupt_own_copy_is_quarantined_and_the_replica_of_the_same_step_is_used(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    at_20 = _save(tiers, state, 20)
    _copy_as_replica(tiers, 20)
    _flip_a_byte(tiers.store.step_path(20) / STATE_FILE)
    again = _tiers(cfg, "a1")
    back, plan = _restore_into_fresh_state(cfg, again)
    assert plan.restore.step == 20 and plan.restore.tier == "peer" and "replica" in plan.restore.source
    assert len(plan.rejected) == 1 and "step-000000020" in plan.rejected[0] and STATE_FILE in plan.rejected[0]
    _assert_same(_weights(back), at_20)
    assert again.store.committed_steps() == [10], "the corrupt copy left the store"
    assert list(again.store.layout.quarantine_dir.glob("step-000000020*")), "and is kept in quarantine"


def test_with_every_copy_of_the_newest_step_bad_the_step_before_is_restored(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    tiers, state = _tiers(cfg), _state(cfg)
    at_10 = _save(tiers, state, 10)
    _save(tiers, state, 20)
    _save(tiers, state, 30)
    replica = _copy_as_replica(tiers, 30)
    _flip_a_byte(tiers.store.step_path(30) / STATE_FILE)
    _flip_a_byte(replica / STATE_FILE)
    (tiers.store.step_path(20) / COMMITTED_NAME).unlink()  # a publish that never finished
    back, plan = _restore_into_fresh_state(cfg, _tiers(cfg, "a1"))
    assert plan.restore.step == 10 and plan.restore.tier == "local"
    assert sorted(r.split("step-")[1][:9] for r in plan.rejected) == ["000000020", "000000030", "000000030"]
    _assert_same(_weights(back), at_10)


def test_copies_saved_at_another_topology_are_not_loaded_and_are_named_for_the_reshardable_tier(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    plan = _tiers(cfg, "a1", {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}).plan_restore()
    assert plan.restore is None and plan.rejected == []
    assert len(plan.skipped_topology) == 1 and "step-000000010" in plan.skipped_topology[0]
    assert "saved at world 1" in plan.skipped_topology[0] and "now world 2" in plan.skipped_topology[0]


def _publish_in_background(tiers: PerRankCheckpoints, state: TrainingState, step: int) -> None:
    _train_to(state, step)
    tiers.start_async(state)
    assert tiers.in_flight == step and tiers.busy()
    deadline = time.monotonic() + 60
    result = None
    while result is None and time.monotonic() < deadline:
        result = tiers.poll_async()
        time.sleep(0.01)
    assert result is not None and result.step == step and tiers.store.committed_steps()[0] == step
    assert tiers.in_flight is None and not tiers.busy()


@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_a_background_save_is_published_by_later_polls(tmp_path: Path, mode: str) -> None:
    cfg = _cfg(tmp_path, f"checkpoint.async.mode={mode}")
    tiers, state = _tiers(cfg), _state(cfg)
    _publish_in_background(tiers, state, 10)
    _publish_in_background(tiers, state, 20)
    at_20 = _weights(state)
    back, plan = _restore_into_fresh_state(cfg, _tiers(cfg, "a1"))
    assert plan.restore.step == 20 and tiers.store.committed_steps() == [20, 10]
    _assert_same(_weights(back), at_20)


def test_an_abandoned_background_save_is_never_published_and_the_next_attempt_saves_that_step(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path, "checkpoint.async.mode=fork")  # a fork writer can be stopped
    tiers, state = _tiers(cfg), _state(cfg)
    _publish_in_background(tiers, state, 10)
    _train_to(state, 20)
    tiers.start_async(state)
    tiers.abandon_async()
    assert tiers.in_flight is None and tiers.store.committed_steps() == [10]
    after = _tiers(cfg, "a1")  # its prepare() clears what the stopped writer left
    assert not list(after.store.layout.steps_dir.glob("*.tmp-*"))
    at_20 = _save(after, state, 20)
    back, plan = _restore_into_fresh_state(cfg, _tiers(cfg, "a2"))
    assert plan.restore.step == 20
    _assert_same(_weights(back), at_20)


def test_a_failed_background_write_raises_publish_error_and_keeps_older_steps(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "checkpoint.async.mode=thread",
        "fault_tolerance.inject.writer_fault=fail",
        "fault_tolerance.inject.writer_fault_at_step=20",
    )
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    _train_to(state, 20)
    tiers.start_async(state)
    with pytest.raises(PublishError, match="step 20 is not complete in tier 1"):
        tiers.poll_async(block=True)
    assert tiers.store.committed_steps() == [10] and tiers.in_flight is None
    assert _tiers(cfg, "a1").plan_restore().restore.step == 10


def test_retention_keeps_the_newest_steps_of_the_own_store(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "checkpoint.local.keep=2")
    tiers, state = _tiers(cfg), _state(cfg)
    for step in (10, 20, 30, 40):
        _save(tiers, state, step)
    assert tiers.store.committed_steps() == [40, 30]
    assert sorted(p.name for p in tiers.store.layout.run_dir.glob("steps/step-*")) == [
        "step-000000030",
        "step-000000040",
    ]


def test_the_object_store_restores_its_newest_verified_step_and_skips_a_corrupt_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    _save(tiers, state, 20)
    remote = RemoteTier.open(f"file://{tmp_path / 's3'}", tiers.run_id)
    remote.acquire_lease("me")
    for step in (10, 20):
        remote.upload_step(tiers.store.step_path(step))
    assert remote.committed_steps() == [20, 10] and remote.latest_hint() == 20
    key = remote.step_key(20, STATE_FILE)
    data, _ = remote.store.get_bytes(key)
    remote.store.put_bytes(key, data[:-1] + bytes([data[-1] ^ 0xFF]))
    step, rejected = remote.restore_newest(RunLayout(tmp_path / "back", tiers.run_id), "r")
    assert step == 10
    assert [s for s, _ in rejected] == [20] and STATE_FILE in rejected[0][1]
    gc = remote.gc(keep=1, milestone_every=0, dry_run=True)
    assert gc.keep == [10, 20] and gc.marked_now == [], "the newest and the verified step before it are kept"
