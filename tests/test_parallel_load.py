"""The reshardable tier's load is spread over the data-parallel ranks (issue 45 #4): two real gloo
ranks (TP 1, PP 1, DP 2) build the tiny GPT, save its Megatron distributed checkpoint through the
tier's fully parallel save strategy, then load it into a model initialised differently, through
the tier's ``load_strategy``: Megatron's ``FullyParallelLoadStrategyWrapper`` around the default
strategy, which here records every shard the storage strategy was asked to read. Each rank reads
about half of the replicated shards, the two shares are disjoint and together every shard, and the
loaded weights equal the saved ones bit for bit. Without the wrapper each rank reads every shard
(the reads DP times over that the wrapper removes)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy

from pretrain.checkpointing.reshardable import load_strategy, save_strategy
from pretrain.config import load_config, padded_vocab_size
from pretrain.model import build_model, transformer_config
from pretrain.platform import cpu_shims
from tests.helpers import TINY, two_gloo_ranks


class RecordingLoad(LoadShardedStrategy):
    """Megatron's storage read strategy, unchanged, noting every shard it reads (key@offset: bytes)."""

    def __init__(self, inner: LoadShardedStrategy) -> None:
        super().__init__()
        self.inner = inner
        self.read: dict[str, int] = {}

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):  # a shard: the tensor's key and its offset (stacked layers)
                self.read[f"{sh.key}@{sh.global_offset}"] = sh.data.numel() * sh.data.element_size()
        return self.inner.load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        return self.inner.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        return self.inner.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: Any) -> Any:
        return self.inner.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: Any) -> Any:
        return self.inner.check_version_compatibility(loaded_version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.inner.can_handle_sharded_objects


def _model(seed: int) -> torch.nn.Module:
    cfg = load_config(TINY, [])
    torch.manual_seed(seed)
    return build_model(cfg.model, padded_vocab_size(cfg), transformer_config(cfg.model, cfg.parallel))


def _load(model: torch.nn.Module, checkpoint: Path, wrapped: bool) -> dict[str, int]:
    """Load ``checkpoint`` into ``model``; what this rank's storage strategy read."""
    recording = RecordingLoad(get_default_load_sharded_strategy(str(checkpoint)))
    strategy = load_strategy(checkpoint, base=recording) if wrapped else recording
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint), strategy)
    model.load_state_dict(loaded, strict=True)
    return recording.read


def _scenario(rank: int, root: Path) -> dict[str, Any]:
    cpu_shims.install()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        saved = _model(seed=1)  # the same weights on both DP ranks, as after any step
        checkpoint = root / "step" / "model"
        checkpoint.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(saved.sharded_state_dict(), str(checkpoint), save_strategy())
        expect = {k: v.detach().clone() for k, v in saved.state_dict().items() if isinstance(v, torch.Tensor)}
        fresh = _model(seed=100 + rank)  # other weights on each rank: only the load can make them equal
        differed = sum(not torch.equal(expect[k], v) for k, v in fresh.state_dict().items() if k in expect)
        read = _load(fresh, checkpoint, wrapped=True)
        got = fresh.state_dict()
        unequal = [k for k, v in expect.items() if not (torch.equal(v, got[k]) and v.dtype == got[k].dtype)]
        unwrapped = _load(_model(seed=200 + rank), checkpoint, wrapped=False)
        return {"read": read, "unwrapped": unwrapped, "unequal": unequal, "tensors": len(expect), "differed": differed}
    finally:
        parallel_state.destroy_model_parallel()


def test_a_reshardable_load_at_dp2_reads_each_shard_once_across_the_ranks_and_is_bit_exact(tmp_path: Path) -> None:
    ranks = two_gloo_ranks(functools.partial(_scenario), tmp_path)
    shares = [set(r["read"]) for r in ranks]
    every = set(ranks[0]["unwrapped"])
    assert every and set(ranks[1]["unwrapped"]) == every, "without the wrapper each rank reads every shard"
    assert shares[0] and shares[1] and not shares[0] & shares[1], shares
    assert shares[0] | shares[1] == every, every ^ (shares[0] | shares[1])
    total = sum(ranks[0]["unwrapped"].values())
    for r in ranks:
        assert sum(r["read"].values()) < 0.75 * total, (sum(r["read"].values()), total)  # about half each
        assert r["differed"] > 0 and r["unequal"] == [], r["unequal"]
