"""Tiers 1-2: fast per-rank saves to node-local storage, replicated to peers in other domains.

Each rank writes its own state as it lives on that rank (its model and optimizer shards, the
trainer state and its RNG/data cursor; with DP > 1 only its slice of the DP-replicated weights,
gathered over the DP group at load: :mod:`pretrain.checkpointing.dp_slices`) into one ``state.pt``
under the publish protocol, in its own primary store; then the bytes go to
``checkpoint.replication.factor - 1`` peers in other failure domains, which verify them against
the owner's manifest before committing the replica. Loading needs the same topology; another
topology falls back to the reshardable tier.

:class:`PerRankCheckpoints` receives the parts that talk to other ranks, behind typed seams (as
NVRx's local checkpoint manager receives its replication strategy): a :class:`Replicator` and a
:class:`Recovery`, with the :class:`Placement` they share, built for a job by :mod:`.per_rank_assembly`
(called by :mod:`pretrain.checkpointing.tiered`) and on ``SingleProcess`` by a test in one process.
This module owns the synchronous save, the tail of every save (``_publish``: commit, replicate,
retention), room on a full volume, the tier's stall handling and the restore; its base class
(:mod:`.per_rank_background`) holds the background saves; the payload is :mod:`.rank_payload`.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pretrain.checkpointing.async_writer import BackgroundWrite, SnapshotBuffers, save_state
from pretrain.checkpointing.per_rank_background import BackgroundSaves, PublishInFlight
from pretrain.checkpointing.rank_payload import (
    FORMAT,
    HOST_COPIES,
    STATE_FILE,
    apply_payload,
    load_verified_state,
    rank_payload,
)
from pretrain.checkpointing.state import SaveResult, TrainingState, step_manifest
from pretrain.checkpointing.tier_health import DISK_FULL, STALLED, AgreedTierHealth, TierHealth, log_stall
from pretrain.config import Config
from pretrain.errors import ConfigError
from pretrain.resilience.phases import PhaseRecord
from tiering.collective import Collective, SingleProcess
from tiering.digest import ChunkedDigest, HashSpec
from tiering.errors import PublishError, TieringError, UnsafeDirectory
from tiering.local.posix import primary_store, replica_store
from tiering.local.publish import PosixStepPublisher
from tiering.manifest import COMMITTED_NAME
from tiering.peer.placement import RankIdentity
from tiering.peer.replication import ReplicationReport
from tiering.peer.restore import PeerPlanResult, PeerRestore, owner_of
from tiering.system.fsio import dir_size, write_file_durably
from tiering.system.private_dir import private_dir

log = logging.getLogger(__name__)

TIERS_SKIPPED = "tiers 1-2 skipped"  # how a restore says it did not wait on a stalled tier 1


class Replicator(Protocol):
    """Copies this rank's published step to its holders and receives the steps it holds
    (:class:`tiering.peer.replication.PeerReplicator`). Collective over every rank."""

    owners_held: list[int]  # the ranks whose replicas this rank holds
    coll: Collective  # its own group: a background publish runs its collectives there

    def replicate(self, step: int, published: Path | None) -> ReplicationReport: ...


class Recovery(Protocol):
    """Finds, verifies (quarantining bad copies) and if needed fetches the newest step every rank
    can obtain from tiers 1-2 (:class:`tiering.peer.restore.PeerRecovery`). Collective."""

    def recover(self) -> PeerPlanResult: ...


@dataclass(frozen=True)
class Placement:
    """Where this rank runs and where every rank's replicas go, agreed by every rank."""

    node: str
    identities: list[RankIdentity]  # every rank's node and failure domain, by rank
    holders: dict[int, list[int]]  # owner rank -> the ranks that hold its replicas


class PerRankCheckpoints(BackgroundSaves):
    name = "local"
    within_step = False

    def __init__(
        self,
        cfg: Config,
        coll: Collective,
        attempt: str,
        topology: dict[str, int],
        placement: Placement,
        replicator: Replicator,
        recovery: Recovery,
        record_event: Any = None,
        phases: PhaseRecord | None = None,
    ) -> None:
        """Tiers 1-2 of this rank: its own store under ``checkpoint.local.dir``, and the parts it is
        handed (built by :func:`~.per_rank_assembly.build_per_rank_checkpoints` in a job; by a test in one process):
        where every rank and its replicas are (``placement``), what copies a published step to its
        holders (``replicator``) and what finds the newest step every rank can obtain (``recovery``)."""
        self.cfg = cfg
        self.phases = phases
        self.coll = coll
        self.rank = coll.rank
        self.world = coll.world_size
        self.attempt = attempt
        self.topology = topology
        self.keep = cfg.checkpoint.local.keep
        self.run_id = cfg.run.id
        self.node_root = Path(cfg.checkpoint.local.dir) / cfg.run.id
        try:
            private_dir(self.node_root)  # 0700, ours, not a symlink: tier 1 holds the model
        except UnsafeDirectory as exc:
            raise ConfigError(f"{cfg.source}: checkpoint.local.dir: {exc}") from exc
        self.store = primary_store(self.node_root, self.rank, self.run_id, self.keep)
        integrity = cfg.checkpoint.integrity
        self.hashing = HashSpec(integrity.local_hash, integrity.chunk_bytes, integrity.hash_threads)
        self.publisher = PosixStepPublisher(self.store.layout, SingleProcess(), attempt, self.hashing)
        self._record_event = record_event
        # The newest step committed on every rank: retention and make_room never delete it.
        self.complete_step: int | None = None
        self._last_bytes = 0
        self._inflight: dict[str, Any] | None = None
        self._buffers = SnapshotBuffers()
        self._publishing: PublishInFlight | None = None
        ipc = cfg.fault_tolerance.inprocess
        # For in-process restarts; tier 0 (checkpoint.memory) is that host copy when on (see without_tier0).
        self._keep_host_copy = ipc.enabled and ipc.keep_host_copy and cfg.checkpoint.memory.enabled is False
        self.node = placement.node
        self.identities = placement.identities
        self.holders = placement.holders
        self.replicator = replicator
        self.recovery = recovery
        local = cfg.checkpoint.local
        # Every rank probes its own: each owns its writer (tier_health's one rule for every tier).
        health = TierHealth(Path(local.dir) / ".health" / f"probe-{self.rank:05d}", local.probe_interval_s)
        self.storage = AgreedTierHealth(health, self.coll, local.stall_timeout_s, self._report_stall)

    def without_tier0(self) -> None:
        """Tier 0 turned itself off at start (``checkpoint.memory.enabled: auto`` without room): an
        in-process restart's host copy is this tier's again."""
        ipc = self.cfg.fault_tolerance.inprocess
        self._keep_host_copy = ipc.enabled and ipc.keep_host_copy

    def stores(self) -> list[Any]:
        """The tier 1-2 stores on this rank: its own steps and the replicas it holds for peers."""
        return [self.store] + [
            replica_store(self.node_root, o, self.run_id, self.keep) for o in self.replicator.owners_held
        ]

    def prepare(self) -> None:
        """Collective: probe the storage (in its own process, for at most the stall deadline: a
        stalled tier is marked unhealthy and left alone, on every rank); drop this rank's temporary
        directories left by earlier attempts; remember the size of the newest committed step (what
        the first save needs room for)."""
        if not self.storage.probe_at_start():
            return
        for store in self.stores():
            for path in store.clean_stale_tmp(self.attempt):
                log.info("removed unfinished local save of an earlier attempt: %s", path)
        newest = self.store.committed_steps()[:1]
        if newest and not self._last_bytes:
            self._last_bytes = dir_size(self.store.step_path(newest[0]))

    def _needed_bytes(self) -> int:
        """Room the next step needs on this node's volume: every rank of the node writes its own part
        and receives the replicas it holds, all about the size of the last step (0: not known yet)."""
        ranks_here = sum(1 for i in self.identities if i.node == self.node)
        return self._last_bytes * (1 + len(self.replicator.owners_held)) * ranks_here

    def _make_room(self, step: int) -> list[int]:
        """The volume is short of space for ``step``: every store of this rank keeps only its newest
        verified step. Recorded as an event (``room_made``, reason ``disk_full``): a full volume the
        tier moved on from is still one the operator must hear about. Every rank records its own
        (``force``): the ranks of a node share its volume, and whichever checks first makes the
        room (under load a CI run saw only rank 1 do it, and the event was lost). It may run in a
        forked writer: an event is one appended line, safe from there."""
        keep = {self.complete_step} if self.complete_step is not None else set()
        dropped = [s for store in self.stores() for s in store.make_room(keep)]
        if dropped and self._record_event is not None:  # nothing dropped: the save fails, recorded so
            free = shutil.disk_usage(self.store.layout.steps_dir).free
            self._record_event(
                "room_made",
                force=True,
                rank=self.rank,
                tier="local",
                step=step,
                reason=DISK_FULL,
                dropped=dropped,
                free_bytes=free,
                error=f"{self.store.layout.steps_dir}: volume full; dropped steps {dropped} to save step {step}",
            )
        return dropped

    # -- stalled storage (the verdicts: self.storage, tier_health's rule) ----------------------------
    def _report_stall(self, what: str) -> None:
        """The one line a rank logs when its tier-1 storage stops answering."""
        probe_s = self.cfg.checkpoint.local.probe_interval_s
        log_stall(self.rank, "tier 1", self.node_root, what, "checkpoint.local", probe_s)

    def _stalled(self, step: int, what: str, write: BackgroundWrite | None = None) -> PublishError:
        """This rank's save of ``step`` passed its deadline: abandon it and mark the tier unhealthy."""
        if write is not None:
            write.abandon()
        self.storage.stalled(what)
        return PublishError(f"step {step} is not complete in tier 1: {what}")

    # -- save ------------------------------------------------------------------------------------
    def due(self, step: int, final: bool) -> bool:
        return final or step % self.cfg.checkpoint.local.interval == 0

    def save(self, state: TrainingState, deadline: float | None = None) -> SaveResult:
        """Collective, synchronous. Raises PublishError on every rank if any rank could not publish.

        All or nothing: a rank commits its part only when every rank wrote its own, so a step is
        never half-present in tier 1. ``deadline`` (``time.monotonic()``) bounds an emergency save:
        past it, nothing is published. The write is bounded too where a writer process can be
        forked (see :meth:`_write_now`).
        """
        self.finish_publishing()
        self.storage.skip_if_stalled(state.step)
        t0 = time.perf_counter()
        error = None
        tmp: Path | None = None
        payload: dict[str, Any] | None = None
        digest = None
        try:
            payload = self._payload(state)
            tmp, digest, error = self._write_now(state.step, payload, deadline)
        except (TieringError, OSError) as exc:  # storage said no; a bug (TypeError, ...) fails the attempt
            error = str(exc)
        if error is None and deadline is not None and time.monotonic() > deadline:
            error = "emergency save deadline passed before commit"
        manifest = step_manifest(self.cfg.run.id, self.cfg.data, state, FORMAT, self.attempt, owner_rank=self.rank)
        result = self._publish(state.step, tmp, manifest, error, t0, time.perf_counter() - t0, digest)
        self.storage.saved(time.perf_counter() - t0)
        if self._keep_host_copy and payload is not None:
            HOST_COPIES[(self.run_id, self.rank)] = (state.step, copy.deepcopy(payload))
        return result

    def _write_now(
        self, step: int, payload: dict[str, Any], deadline: float | None
    ) -> tuple[Path | None, ChunkedDigest | None, str | None]:
        """A synchronous save's write: (temporary directory, digest, error). Where the writer may
        fork (``_async_mode`` fork: CPU) it runs in a writer process waited for at most the stall
        deadline (and the emergency ``deadline``): storage that stalls fails the save instead of
        holding the training thread in the kernel, where a SIGTERM could not end the rank either.
        Otherwise (GPU) it is written on this thread, unbounded."""
        if self._async_mode() != "fork":
            tmp = self.publisher.begin(step, self._needed_bytes(), lambda: self._make_room(step))
            return tmp, write_file_durably(tmp / STATE_FILE, lambda fh: save_state(payload, fh), self.hashing), None
        tmp, expected = self.store.layout.tmp_dir(step, self.attempt), self._needed_bytes()
        limit = self.storage.deadline()
        if deadline is not None:
            limit = min(limit, max(0.0, deadline - time.monotonic()))

        def make_tmp_dir() -> None:
            self.publisher.begin(step, expected, lambda: self._make_room(step))

        write = BackgroundWrite("fork", payload, tmp / STATE_FILE, prepare=make_tmp_dir, hashing=self.hashing)
        outcome = write.poll(block=True, timeout=limit)
        if outcome is not None:
            return tmp, outcome.digest, outcome.error
        if limit < self.storage.deadline():  # the emergency deadline, not a stall
            write.abandon()
            return None, None, "emergency save deadline passed before commit"
        what = f"{STALLED}: the write of {write.path} did not finish within {limit:.1f}s"
        self._stalled(step, what, write)
        return None, None, what

    def _publish(
        self,
        step: int,
        tmp: Path | None,
        manifest: Any,
        error: str | None,
        t0: float,
        blocked_s: float,
        digest: ChunkedDigest | None = None,
        coll: Collective | None = None,
        peer_error: str | None = None,
    ) -> SaveResult:
        """Collective tail of every save: agree, commit or abort, replicate, apply retention.

        On the training thread (synchronous saves) its collectives use the training group; on
        the publisher thread (background saves), the replication group, whose waits are bounded;
        the writers' outcomes are then already agreed (``peer_error``).
        """
        coll = coll or self.coll
        published: Path | None = None
        if coll is self.coll:
            failed = [(r, e) for r, e in enumerate(coll.all_gather(error)) if e]
            peer_error = f"rank {failed[0][0]}: {failed[0][1]}" if failed else None
        if tmp is not None and tmp.is_dir():
            try:
                if manifest is None:
                    raise PublishError(f"{tmp}: no manifest ({error})")
                known = {STATE_FILE: digest} if digest is not None else None
                self.publisher.commit(tmp, manifest, local_error=error or peer_error, known=known)
                self._last_bytes = manifest.total_bytes
                published = self.store.step_path(step)
            except (PublishError, OSError) as exc:
                error = error or str(exc)
        elif error is None:
            error = peer_error or f"{tmp}: the writer left no temporary directory"
        if error:
            log.error("rank %d: local save of step %d failed: %s", self.rank, step, error)
        local_s = time.perf_counter() - t0
        report = self.replicator.replicate(step, published)
        replication_s = time.perf_counter() - t0 - local_s
        errors = [(r, e) for r, e in enumerate(coll.all_gather(error)) if e]
        if not errors:  # decided after the global outcome: older steps go only once this one is everywhere
            self.complete_step = step
            for old in self.store.apply_retention(protected={step}):
                log.debug("retention: deleted local step %d (keep=%d)", old, self.keep)
            self.replicator.apply_retention({step})
        if errors:
            raise PublishError(f"step {step} is not complete in tier 1: rank {errors[0][0]}: {errors[0][1]}")
        if report.under_replicated and self.rank == 0:
            log.warning(
                "step %d is under-replicated: ranks %s have fewer than %d copies (%s); the next step replicates again",
                step,
                report.under_replicated,
                self.cfg.checkpoint.replication.factor,
                next(iter(report.failures.values())),
            )
        return SaveResult(
            self.name,
            step,
            local_s,
            self._last_bytes,
            published or self.store.step_path(step),
            report.under_replicated,
            replication_s,
            blocked_seconds=blocked_s,
        )

    def _payload(self, state: TrainingState) -> dict[str, Any]:
        return rank_payload(state, self.rank)

    # -- restore ---------------------------------------------------------------------------------
    def committed_inventory(self) -> list[str]:
        """Committed tier 1-2 steps on this rank's node, every owner's primaries and replicas (any
        topology): ``node:root: rank 0 steps [..], replica of rank 1 steps [..]``, or nothing."""
        held = []
        for sub, make, what in (("ranks", primary_store, "rank"), ("replicas", replica_store, "replica of rank")):
            base = self.node_root / sub
            for owner_dir in sorted(base.iterdir()) if base.is_dir() else []:
                owner = owner_of(owner_dir)
                steps = (
                    make(self.node_root, owner, self.run_id, self.keep).committed_steps() if owner is not None else []
                )
                if steps:
                    held.append(f"{what} {owner} steps {steps}")
        return [f"{self.node}:{self.node_root}: {', '.join(held)}"] if held else []

    def plan_restore(self) -> PeerPlanResult:
        """Collective: find (and fetch, if needed) the newest step every rank can obtain; nothing
        (the restore falls back) when any rank's tier-1 storage is stalled."""
        why = self.storage.agreed_healthy()
        if why is not None:
            return PeerPlanResult(None, rejected=[f"{TIERS_SKIPPED}: {why}"])
        return self.recovery.recover()

    def load(self, restore: PeerRestore, state: TrainingState) -> None:
        if self.phases is not None:
            self.phases.enter("load")
        apply_payload(state, load_verified_state(restore.path / STATE_FILE), restore.path / STATE_FILE)

    def host_copy_step(self) -> int | None:
        """Step of this rank's host-memory copy, if it is still the committed step on disk (a
        stat, not a read: quarantined or superseded steps lose their copy's validity)."""
        entry = HOST_COPIES.get((self.run_id, self.rank))
        if entry is None or not (self.store.step_path(entry[0]) / COMMITTED_NAME).is_file():
            return None
        return entry[0]

    def load_host_copy(self, state: TrainingState) -> None:
        step, cached = HOST_COPIES[(self.run_id, self.rank)]
        # A copy: optimizers keep references to loaded tensors and update them in place.
        apply_payload(state, copy.deepcopy(cached), Path(f"<host-memory copy of step {step}>"))

    def step_bytes(self, step: int) -> int:
        return dir_size(self.store.step_path(step))
