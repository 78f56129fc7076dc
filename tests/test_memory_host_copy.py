"""Tier 0's GPU write path, run on CPU (issue 45 #8): the state is first copied into the reusable
arena (one per dtype) and the optimizer step waits for that copy only; the write and seal of the
slot then finish from the arena. ``MemoryTier(host_copy=True)`` runs that same code with CPU
tensors (no stream, no event: the copy is synchronous on the writer thread); only the stream, the
event wait and pinning are CUDA's own, in ``async_writer.copy_tensors``. Proven on real slot files
in the machine's tmpfs: every tensor of the payload is copied (the arenas hold exactly its bytes
per dtype, reused by the next save), the optimizer step's wait returns once the copy is done, an
in-place update right after it is not in the sealed slot, whose bytes equal the state at the save.
Without ``host_copy`` (the CPU default) nothing is copied and the wait is for the seal."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pretrain.checkpointing.memory_tier import MemoryTier
from pretrain.checkpointing.rank_payload import load_verified_state
from pretrain.config import load_config
from tests.helpers import TINY
from tiering.collective import SingleProcess
from tiering.manifest import Manifest

TOPOLOGY = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}


def _tier(root: Path, host_copy: bool | None) -> MemoryTier:
    cfg = load_config(TINY, ["run.id=r", f"checkpoint.memory.dir={root}", "checkpoint.memory.enabled=true"])
    return MemoryTier(cfg, SingleProcess(), "a1", TOPOLOGY, host_copy=host_copy)


def _payload() -> dict:
    """A rank payload's shape: fp32 weights and moments, bf16 weights, an int step, plain values."""
    gen = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(256, 512, generator=gen), "h": torch.randn(300, generator=gen).bfloat16()},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(256, 512, generator=gen), "step": torch.tensor(4.0)}}},
        "trainer": {"step": 4, "name": "tiny"},
    }


def _save(tier: MemoryTier, step: int, payload: dict) -> dict:
    """One save as the trainer drives it: start, the optimizer step's wait, an in-place update of
    every tensor (the optimizer step) right after it, then the collective poll. What was saved."""
    expect = {"w": payload["model"]["w"].clone(), "h": payload["model"]["h"].clone()}
    tier.start_payload(step, payload, Manifest("r", step, 1, TOPOLOGY, []), time.perf_counter())
    job = tier._inflight  # noqa: SLF001 - the job's events are the ordering under test
    assert job is not None
    tier.before_optimizer_step()
    copied, sealed = job.copied.is_set(), job.done is not None and job.done.is_set()
    payload["model"]["w"].add_(1.0)
    payload["model"]["h"].add_(1.0)
    payload["optimizer"]["state"][0]["exp_avg"].mul_(0.5)
    result = tier.poll_async(block=True)
    assert result is not None and result.step == step
    loaded = load_verified_state(tier.store.state_path(_slot(tier, step)))
    return {"expect": expect, "loaded": loaded, "copied": copied, "sealed": sealed}


def _slot(tier: MemoryTier, step: int) -> int:
    found = tier.sealed_slot(step)
    assert found is not None, f"step {step} not sealed"
    return found


def test_the_gpu_write_path_on_cpu_copies_every_tensor_then_seals_the_state_at_the_save(shm_root: Path) -> None:
    tier = _tier(shm_root, host_copy=True)
    payload = _payload()
    before_exp_avg = payload["optimizer"]["state"][0]["exp_avg"].clone()
    got = _save(tier, 4, payload)
    assert got["copied"], "the optimizer step's wait returned before the copy"
    loaded = got["loaded"]
    assert torch.equal(loaded["model"]["w"], got["expect"]["w"]), "an update after the wait reached the slot"
    assert torch.equal(loaded["model"]["h"], got["expect"]["h"]) and loaded["model"]["h"].dtype == torch.bfloat16
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], before_exp_avg)
    assert loaded["trainer"] == {"step": 4, "name": "tiny"}
    tensors = [payload["model"]["w"], payload["model"]["h"], payload["optimizer"]["state"][0]["exp_avg"]]
    tensors.append(payload["optimizer"]["state"][0]["step"])
    per_dtype: dict[torch.dtype, int] = {}
    for t in tensors:
        per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + t.numel()
    arenas = tier._buffers.arenas  # noqa: SLF001
    assert {d: a.numel() for d, a in arenas.items()} == per_dtype, "the arenas hold exactly the payload's tensors"
    assert not any(a.is_pinned() for a in arenas.values())  # pinned on GPU hosts only
    allocations = tier._buffers.allocations  # noqa: SLF001
    got = _save(tier, 5, payload)  # same layout: the arenas are reused, the slot holds step 5's state
    assert tier._buffers.allocations == allocations  # noqa: SLF001
    assert torch.equal(got["loaded"]["model"]["w"], got["expect"]["w"])


def test_without_the_host_copy_cpu_serialises_the_live_tensors_and_waits_for_the_seal(shm_root: Path) -> None:
    tier = _tier(shm_root, host_copy=None)  # the CPU default
    got = _save(tier, 4, _payload())
    assert got["sealed"], "on CPU the optimizer step waits for the seal (the one-step loss bound)"
    assert torch.equal(got["loaded"]["model"]["w"], got["expect"]["w"])
    assert tier._buffers.arenas == {} and tier._buffers.allocations == 0  # noqa: SLF001


def test_the_arena_is_reserved_at_start_up_and_the_saves_allocate_nothing(shm_root: Path) -> None:
    """What check_capacity reserves (the state by dtype, after the first step) serves every save,
    a first step's new moments included: no allocation inside a saving step."""
    tier = _tier(shm_root, host_copy=True)
    payload = _payload()
    moments = {"exp_avg_sq": torch.zeros(256, 512)}  # what the first step will add
    by_dtype = {torch.float32: (256 * 512 * 3 + 1) * 4, torch.bfloat16: 300 * 2}
    tier.reserve_arenas(by_dtype, pin=False)
    assert tier._buffers.allocations == 2  # noqa: SLF001
    _save(tier, 4, payload)
    payload["optimizer"]["state"][0].update(moments)
    got = _save(tier, 5, payload)
    assert tier._buffers.allocations == 2, "a save allocated although the reserved arenas fit"  # noqa: SLF001
    assert torch.equal(got["loaded"]["optimizer"]["state"][0]["exp_avg_sq"], torch.zeros(256, 512))
    assert torch.equal(got["loaded"]["model"]["w"], got["expect"]["w"])
    default = _tier(shm_root, host_copy=None)  # the CPU default: nothing is copied, so nothing reserved
    default.reserve_arenas(by_dtype, pin=False)
    assert default._buffers.allocations == 0  # noqa: SLF001
