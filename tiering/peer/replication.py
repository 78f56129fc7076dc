"""Tier 2: every rank's published local step is copied to peers in other failure domains.

Layout on each node's local root (``<checkpoint.local.dir>/<run id>/``):

    ranks/rank-00003/steps/step-000000120/      primary copies written by rank 3 on this node
    replicas/rank-00001/steps/step-000000120/   replicas this node holds for rank 1

A replica is published (``COMMITTED``) only after every received byte matched the owner's
manifest; one that does not match is discarded, never served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiering.collective import Collective
from tiering.errors import PublishError, VerificationError
from tiering.local.posix import PosixTier, replica_store
from tiering.local.publish import publish_received
from tiering.peer.transport import OutgoingStep, ReceivedStep, Transport

log = logging.getLogger(__name__)


@dataclass
class ReplicationReport:
    step: int
    under_replicated: list[int] = field(default_factory=list)  # owners missing at least one replica
    failures: dict[int, str] = field(default_factory=dict)  # owner -> first reason (any holder)


class PeerReplicator:
    """Sends this rank's published step to its holders and receives the steps it holds."""

    def __init__(
        self,
        run_id: str,
        rank: int,
        holders: dict[int, list[int]],
        node_root: Path,
        transport: Transport,
        coll: Collective,
        keep: int,
        attempt: str,
        before_accept: Callable[[int, int], None] | None = None,
    ) -> None:
        self.run_id = run_id
        self.rank = rank
        self.holders = holders
        self.node_root = node_root
        self.transport = transport
        self.coll = coll
        self.keep = keep
        self.attempt = attempt
        self.before_accept = before_accept  # fault-injection hook: (owner, step)
        self.owners_held = sorted(o for o, hs in holders.items() if rank in hs)

    def replicate(self, step: int, published: Path | None) -> ReplicationReport:
        """Collective over every rank. ``published`` is this rank's step directory, or None if its save failed."""
        payload = None
        if published is not None:
            header = {"run_id": self.run_id, "step": step, "owner": self.rank, "kind": "replica"}
            payload = OutgoingStep.of(published, header)
        outgoing: dict[int, OutgoingStep | None] = {holder: payload for holder in self.holders.get(self.rank, [])}
        into = {owner: self._store(owner).layout.tmp_dir(step, self.attempt) for owner in self.owners_held}
        received, errors = self.transport.exchange(outgoing, into)
        outcomes: dict[int, str] = {}
        for owner in self.owners_held:
            if owner in errors:
                outcomes[owner] = f"transfer from rank {owner} failed: {errors[owner]}"
            elif owner not in received:
                outcomes[owner] = f"rank {owner} had no published step {step} to send"
            else:
                outcomes[owner] = self._accept(owner, step, received[owner])
        try:
            gathered = self.coll.all_gather(outcomes)
        except Exception as exc:  # a peer is gone (the launcher restarts the group): assume the worst
            reason = f"replication of step {step} unconfirmed, a peer was lost: {str(exc).splitlines()[0]}"
            log.error("step %d is under-replicated: %s", step, reason)
            gathered = [outcomes, {owner: reason for owner in self.holders}]
        report = ReplicationReport(step)
        for per_holder in gathered:
            for owner, outcome in per_holder.items():
                if outcome != "ok":
                    report.failures.setdefault(int(owner), outcome)
        report.under_replicated = sorted(report.failures)
        return report

    def apply_retention(self, protected: set[int]) -> None:
        """Every replica store held here keeps its newest steps; the caller runs it only once a
        step is committed on every rank (a replica of the newest complete step is never dropped
        for steps that are not complete everywhere)."""
        for owner in self.owners_held:
            self._store(owner).apply_retention(protected=protected)

    def _store(self, owner: int) -> PosixTier:
        return replica_store(self.node_root, owner, self.run_id, self.keep)

    def _accept(self, owner: int, step: int, received: ReceivedStep) -> str:
        try:
            if self.before_accept is not None:
                self.before_accept(owner, step)
            publish_received(self._store(owner).layout, received, self.run_id, step, owner)
            return "ok"
        except (VerificationError, PublishError, OSError, ValueError) as exc:
            log.error("replica of rank %d step %d rejected: %s", owner, step, exc)
            return f"replica rejected: {exc}"
