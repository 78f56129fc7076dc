"""Tiers 1-2 of a rank as a job assembles them: the replica placement every rank agrees on, then
the replicator and the recovery on the transport, handed to
:class:`~pretrain.checkpointing.per_rank.PerRankCheckpoints`.

:func:`agree_placement` gathers every rank's node and failure domain (refusing two nodes that
report one node name: :func:`_refuse_shared_node_names`) and picks each rank's replica holders;
:func:`build_per_rank_checkpoints` builds :class:`tiering.peer.replication.PeerReplicator` and
:class:`tiering.peer.restore.PeerRecovery` on them. It never saves or restores. Called by
:mod:`pretrain.checkpointing.tiered` in a job and by tests in one process (``Transport(None, ...)``
and ``SingleProcess()``).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from pretrain.checkpointing.per_rank import PerRankCheckpoints, Placement
from pretrain.config import Config, ReplicationConfig
from pretrain.errors import ConfigError
from pretrain.resilience.faults import maybe_die_while_receiving
from pretrain.resilience.phases import PhaseRecord
from tiering.collective import Collective
from tiering.peer.placement import PlacementError, RankIdentity, failure_domain, node_name, replica_holders
from tiering.peer.replication import PeerReplicator
from tiering.peer.restore import PeerRecovery
from tiering.peer.transport import Transport

log = logging.getLogger(__name__)


def build_per_rank_checkpoints(
    cfg: Config,
    coll: Collective,
    attempt: str,
    topology: dict[str, int],
    transport: Transport,
    replication_coll: Collective,
    record_event: Any = None,
    phases: PhaseRecord | None = None,
) -> PerRankCheckpoints:
    """Tiers 1-2 of this rank as a job builds them: the placement agreed by every rank (one
    gather on ``coll``), then the replicator and the recovery on ``transport`` and
    ``replication_coll`` (the replication group, whose waits are bounded on their own). In one
    process: ``Transport(None, ...)`` and ``SingleProcess()`` (a rank with no peers sends nothing)."""
    placement = agree_placement(cfg.checkpoint.replication, cfg.source, coll)
    rank = coll.rank
    node_root = Path(cfg.checkpoint.local.dir) / cfg.run.id
    keep = cfg.checkpoint.local.keep

    def before_accept(owner: int, step: int) -> None:  # the deliberate fault of a receiving peer
        maybe_die_while_receiving(cfg.fault_tolerance.inject, rank, owner, step, record_event)

    replicator = PeerReplicator(
        cfg.run.id, rank, placement.holders, node_root, transport, replication_coll, keep, attempt, before_accept
    )
    recovery = PeerRecovery(
        cfg.run.id,
        rank,
        coll.world_size,
        placement.node,
        node_root,
        coll,
        transport,
        topology,
        keep,
        attempt,
        on_phase=phases.enter if phases is not None else lambda phase: None,
    )
    if rank == 0:
        log.info(
            "replica placement (owner -> holders): %s; domains: %s",
            placement.holders,
            {i.rank: i.domain for i in placement.identities},
        )
    return PerRankCheckpoints(cfg, coll, attempt, topology, placement, replicator, recovery, record_event, phases)


def agree_placement(rep: ReplicationConfig, source: str, coll: Collective) -> Placement:
    """Collective: every rank's node and failure domain, and the holders of each rank's replicas
    (``source``: the config file, named by a refusal)."""
    node = node_name(rep.node)
    launcher = (os.environ.get("GROUP_RANK", "0"), socket.gethostname())
    rows = coll.all_gather((node, failure_domain(node, rep.domains), launcher))
    _refuse_shared_node_names(source, [(name, host) for name, _, host in rows])
    identities = [RankIdentity(r, n, d) for r, (n, d, _) in enumerate(rows)]
    try:
        holders = replica_holders(identities, rep.factor, rep.allow_same_domain)
    except PlacementError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return Placement(node, identities, holders)


def _refuse_shared_node_names(source: str, rows: list[tuple[str, tuple[str, str]]]) -> None:
    """Ranks of different launchers (nodes) must not report the same node name: replicas would be
    placed, and a lost node's copies looked for, on the wrong node (restores found no step)."""
    seen: dict[str, tuple[str, str]] = {}
    for node, launcher in rows:
        other = seen.setdefault(node, launcher)
        if other[0] != launcher[0]:
            raise ConfigError(
                f"{source}: node {other[0]} (host {other[1]}) and node {launcher[0]} (host {launcher[1]}) both "
                f"report node name {node!r}; fix: set NODE_NAME to a unique name per node (Kubernetes: the "
                "downward API's spec.nodeName; Slurm: SLURMD_NODENAME is set per node) or leave "
                "checkpoint.replication.node unset"
            )
