"""What a rank saves of itself in tiers 0-2, and how it is loaded back.

Owns the payload's format tag (:data:`FORMAT`), the file it is stored under in a tier 1-2 step
(:data:`STATE_FILE`), building it from the live training state (:func:`rank_payload`: references
to the live tensors, but for the model's weights with DP > 1 this DP rank's slice, see
:mod:`pretrain.checkpointing.dp_slices`), mapping a verified ``state.pt`` (:func:`load_verified_state`)
and loading a payload into the training state (:func:`apply_payload`, collective over the DP group
when the weights were split). :data:`HOST_COPIES` is this process's host-memory copy of the newest
tier-1 payload it committed (in-process restarts). It never writes, publishes, verifies or decides
which step to restore. Called by :mod:`pretrain.checkpointing.per_rank` (tiers 1-2) and
:mod:`pretrain.checkpointing.memory_tier` (tier 0), which share this format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from pretrain.checkpointing import dp_slices, raw_payload
from pretrain.checkpointing.state import TrainingState, apply_trainer_state, trainer_state
from pretrain.rank_state import rank_state, restore_rng

FORMAT = "per-rank-torch/v1"
STATE_FILE = "state.pt"

# The newest tier-1 payload this process committed, per (run, rank): it outlives an in-process
# restart (same process), so the next incarnation restores without reading the disk.
HOST_COPIES: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}


def apply_payload(state: TrainingState, payload: dict[str, Any], where: Path) -> None:
    """Load a per-rank payload (tier 0 or tiers 1-2: the same format) into the training state."""
    apply_trainer_state(state, payload["trainer"], where)
    if dp_slices.SPLIT_KEY in payload:  # collective over the DP group: every DP rank restores this step
        model_state = dp_slices.gather(payload[dp_slices.SPLIT_KEY], parallel_state.get_data_parallel_group_gloo())
    else:
        model_state = payload["model"]
    state.model.load_state_dict(model_state, strict=True)
    on_cpu = all(p.device.type == "cpu" for p in state.model.parameters())
    state.optimizer.load_local_state_dict(owned_tensors(payload["optimizer"]) if on_cpu else payload["optimizer"])
    restore_rng(payload["rank_state"]["rng"])


def owned_tensors(value: Any) -> Any:
    """``value`` with every tensor copied into memory of its own. A CPU optimizer keeps the tensors
    it is given (a load to the same device and dtype is no copy): from :func:`load_verified_state`
    they would be views of the mapped checkpoint file, which would then stay mapped for the life
    of the rank, its disk space held after retention deletes it (a full tier 1 that pruning cannot
    free) and its tier-0 slot memory with it. On GPU the load copies them to the device anyway."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: owned_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(owned_tensors(v) for v in value)
    return value


def load_verified_state(path: Path) -> dict[str, Any]:
    """Load a ``state.pt`` whose every chunk was just verified (the restore's one read of the
    disk): mapped, not read again, so the load costs no second pass over the bytes and no second
    copy in memory; tensors are paged in from the verified pages as they are used. Tier 0 writes
    the raw layout (:mod:`pretrain.checkpointing.raw_payload`, and tier 1 holds it where the agent
    persisted a slot); tier 1's own writers ``torch.save``: the file says which."""
    return raw_payload.read(path)


def rank_payload(state: TrainingState, rank: int) -> dict[str, Any]:
    """What a rank saves of itself (tiers 0-2): references to the live tensors, not copies, but for
    the model's weights with DP > 1: this DP rank's slice of them, copied (:mod:`.dp_slices`)."""
    cursor = state.sampler.cursor(state.consumed_samples)
    dp = state.topology.get("dp", 1)
    model: dict[str, Any] = {"model": state.model.state_dict()}
    if dp > 1:
        model = {dp_slices.SPLIT_KEY: dp_slices.split(model["model"], dp, parallel_state.get_data_parallel_rank())}
    return {
        "format": FORMAT,
        **model,
        "optimizer": state.optimizer.local_state_dict(),
        "trainer": trainer_state(state),
        "rank_state": rank_state(rank, state.topology, cursor),
    }
