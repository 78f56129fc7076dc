"""When each tier saves, and the recovery order: own local copy -> peer replica -> reshardable tier."""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch.distributed as dist

from pretrain.checkpointing.per_rank import PerRankCheckpoints
from pretrain.checkpointing.reshardable import ReshardableCheckpoints
from pretrain.checkpointing.state import RestoreResult, SaveResult, TrainingState
from pretrain.config import Config
from tiering.collective import Collective

log = logging.getLogger(__name__)


class TieredCheckpointer:
    def __init__(
        self, cfg: Config, coll: Collective, attempt: str, topology: dict[str, int], record_event: Any = None
    ) -> None:
        self.cfg = cfg
        self.coll = coll
        self.local: PerRankCheckpoints | None = None
        self.reshardable: ReshardableCheckpoints | None = None
        if cfg.checkpoint.local.enabled:
            # Replication gets its own gloo group so that its waits are bounded independently of
            # the training group (which may be NCCL on GPUs).
            group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=cfg.checkpoint.replication.timeout_s)
            )
            self.local = PerRankCheckpoints(cfg, coll, attempt, topology, group, record_event)
        if cfg.checkpoint.reshardable.enabled:
            self.reshardable = ReshardableCheckpoints(cfg, coll, attempt)

    def prepare(self) -> None:
        for tier in (self.local, self.reshardable):
            if tier is not None:
                tier.prepare()

    def due(self, step: int) -> list[Any]:
        final = step == self.cfg.train.steps
        tiers = []
        if self.local is not None and (step % self.cfg.checkpoint.local.interval == 0 or final):
            tiers.append(self.local)
        if self.reshardable is not None and (step % self.cfg.checkpoint.reshardable.interval == 0 or final):
            tiers.append(self.reshardable)
        return tiers

    def save(self, tier: Any, state: TrainingState) -> SaveResult:
        return tier.save(state)

    def restore(self, state: TrainingState) -> RestoreResult | None:
        """Collective. Newest step wins; at equal steps the faster tier (local, then peer) wins."""
        t0 = time.perf_counter()
        notes: list[str] = []
        plan = self.local.plan_restore() if self.local is not None else None
        if plan is not None and plan.skipped_topology:
            notes.append(
                f"tier 1-2 copies saved at another topology are not loadable here, using the reshardable "
                f"tier: {plan.skipped_topology[0]}"
            )
            if self.coll.rank == 0:
                log.warning(notes[-1])
        peer = plan.restore if plan is not None else None
        newest_reshardable = self.reshardable.newest_committed() if self.reshardable is not None else None
        if peer is not None and (newest_reshardable is None or newest_reshardable <= peer.step):
            return self._load_peer(peer, plan, state, t0, notes)
        if self.reshardable is not None:
            result = self.reshardable.restore(state)
            if result is not None and (peer is None or result.step >= peer.step):
                result.notes = notes
                return result
        if peer is not None:  # the reshardable tier had nothing newer that verified
            return self._load_peer(peer, plan, state, t0, notes)
        return None

    def _load_peer(self, peer: Any, plan: Any, state: TrainingState, t0: float, notes: list[str]) -> RestoreResult:
        assert self.local is not None
        t_load = time.perf_counter()
        self.local.load(peer, state)
        per_rank = self.coll.all_gather(
            {
                "rank": self.coll.rank,
                "tier": peer.tier,
                "source": peer.source,
                "step": peer.step,
                "seconds": round(peer.seconds + time.perf_counter() - t_load, 4),
            }
        )
        if self.coll.rank == 0:
            for row in per_rank:
                log.info(
                    "restore: rank %d used tier %s (%s) step %d in %.3fs",
                    row["rank"],
                    row["tier"],
                    row["source"],
                    row["step"],
                    row["seconds"],
                )
        tier = "local" if all(r["tier"] == "local" for r in per_rank) else "peer"
        rejected = [(peer.step, r) for r in plan.rejected]
        self.coll.barrier()
        return RestoreResult(
            tier, peer.step, time.perf_counter() - t0, peer.seconds, True, rejected, peer.path, per_rank, notes
        )
