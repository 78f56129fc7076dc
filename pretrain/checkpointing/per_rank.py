"""Tiers 1-2: fast per-rank saves to node-local storage, replicated to peers in other domains.

Each rank writes its own state as it lives on that rank (its model and optimizer shards, the
trainer state and its RNG/data cursor; with DP > 1 only its slice of the DP-replicated weights,
gathered over the DP group at load: :mod:`pretrain.checkpointing.dp_slices`) into one ``state.pt``
under the publish protocol, in its
own primary store; then the bytes go to ``checkpoint.replication.factor - 1`` peers in other
failure domains, which verify them against the owner's manifest before committing the replica.
Loading needs the same topology; another topology falls back to the reshardable tier.

:class:`PerRankCheckpoints` receives the parts that talk to other ranks, behind typed seams (as
NVRx's local checkpoint manager receives its replication strategy): a :class:`Replicator` and a
:class:`Recovery`, with the :class:`Placement` they share. :func:`build_per_rank_checkpoints` is
where a job builds them (called by :mod:`pretrain.checkpointing.tiered`); a test in one process
builds the same parts on ``SingleProcess``.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from megatron.core import parallel_state

from pretrain.checkpointing import dp_slices
from pretrain.checkpointing.async_writer import BackgroundWrite, SnapshotBuffers, save_state
from pretrain.checkpointing.state import (
    SaveResult,
    TrainingState,
    apply_trainer_state,
    one_line,
    step_manifest,
    trainer_state,
)
from pretrain.checkpointing.tier_health import (
    DISK_FULL,
    STALLED,
    TierHealth,
    TierStalled,
    log_stall,
    stall_deadline,
)
from pretrain.config import Config, ReplicationConfig
from pretrain.errors import ConfigError
from pretrain.rank_state import rank_state, restore_rng
from pretrain.resilience.faults import maybe_die_while_receiving, writer_fault
from pretrain.resilience.phases import PhaseRecord
from tiering.collective import Collective, SingleProcess
from tiering.digest import ChunkedDigest, HashSpec
from tiering.errors import PublishError, TieringError, UnsafeDirectory
from tiering.local.posix import primary_store, replica_store
from tiering.manifest import COMMITTED_NAME
from tiering.peer.placement import PlacementError, RankIdentity, failure_domain, node_name, replica_holders
from tiering.peer.replication import PeerReplicator, ReplicationReport
from tiering.peer.restore import PeerPlanResult, PeerRecovery, PeerRestore, owner_of
from tiering.peer.transport import Transport
from tiering.publish import PosixStepPublisher
from tiering.system.fsio import dir_size, write_file_durably
from tiering.system.private_dir import private_dir

log = logging.getLogger(__name__)

FORMAT = "per-rank-torch/v1"
STATE_FILE = "state.pt"
TIERS_SKIPPED = "tiers 1-2 skipped"  # how a restore says it did not wait on a stalled tier 1

# The newest tier-1 payload this process committed, per (run, rank): it outlives an in-process
# restart (same process), so the next incarnation restores without reading the disk.
_HOST_COPIES: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}


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


class PerRankCheckpoints:
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
        handed (built by :func:`build_per_rank_checkpoints` in a job; by a test in one process):
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
        self._publishing: _PublishInFlight | None = None
        ipc = cfg.fault_tolerance.inprocess
        # For in-process restarts; tier 0 (checkpoint.memory) is that host copy when enabled.
        self._keep_host_copy = ipc.enabled and ipc.keep_host_copy and not cfg.checkpoint.memory.enabled
        self.node = placement.node
        self.identities = placement.identities
        self.holders = placement.holders
        self.replicator = replicator
        self.recovery = recovery
        local = cfg.checkpoint.local
        self.health = TierHealth(Path(local.dir) / ".health" / f"probe-{self.rank:05d}", local.probe_interval_s)
        self._slowest_s = 0.0  # the slowest tier-1 save of this attempt (the default stall deadline)

    def stores(self) -> list[Any]:
        """The tier 1-2 stores on this rank: its own steps and the replicas it holds for peers."""
        return [self.store] + [
            replica_store(self.node_root, o, self.run_id, self.keep) for o in self.replicator.owners_held
        ]

    def prepare(self) -> None:
        """Probe the storage (in its own process, for at most the stall deadline: a stalled tier is
        marked unhealthy and left alone); drop this rank's temporary directories left by earlier
        attempts; remember the size of the newest committed step (what the first save needs room for)."""
        if not self.health.check_now(self.stall_deadline()):
            self._report_stall(f"{self.health.reason}")
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

    # -- stalled storage ---------------------------------------------------------------------------
    def stall_deadline(self) -> float:
        """Seconds a save (or the start-of-attempt probe) may take before the storage counts as stalled."""
        return stall_deadline(self.cfg.checkpoint.local.stall_timeout_s, self._slowest_s)

    def agree_healthy(self) -> bool:
        """Collective: is every rank's tier-1 storage answering? (Non-blocking on each rank: a
        stalled one is probed in the background, see :class:`TierHealth`.)"""
        return all(self.coll.all_gather(self.health.usable()))

    def _report_stall(self, what: str) -> None:
        """The one line a rank logs when its tier-1 storage stops answering."""
        probe_s = self.cfg.checkpoint.local.probe_interval_s
        log_stall(self.rank, "tier 1", self.node_root, what, "checkpoint.local", probe_s)

    def _skip_if_stalled(self, step: int) -> None:
        if not self.agree_healthy():
            why = self.health.reason or "another rank's tier-1 storage is stalled"
            raise TierStalled(f"tier 1 save of step {step} skipped: {why}")

    def _stalled(self, step: int, what: str, write: BackgroundWrite | None = None) -> PublishError:
        """This rank's save of ``step`` passed its deadline: abandon it and mark the tier unhealthy."""
        if write is not None:
            write.abandon()
        if self.health.mark_stalled(what):
            self._report_stall(what)
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
        self._skip_if_stalled(state.step)
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
        manifest = step_manifest(self.cfg, state, FORMAT, self.attempt, owner_rank=self.rank)
        result = self._publish(state.step, tmp, manifest, error, t0, time.perf_counter() - t0, digest)
        self._slowest_s = max(self._slowest_s, time.perf_counter() - t0)
        if self._keep_host_copy and payload is not None:
            _HOST_COPIES[(self.run_id, self.rank)] = (state.step, copy.deepcopy(payload))
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
        limit = self.stall_deadline()
        if deadline is not None:
            limit = min(limit, max(0.0, deadline - time.monotonic()))

        def make_tmp_dir() -> None:
            self.publisher.begin(step, expected, lambda: self._make_room(step))

        write = BackgroundWrite("fork", payload, tmp / STATE_FILE, prepare=make_tmp_dir, hashing=self.hashing)
        outcome = write.poll(block=True, timeout=limit)
        if outcome is not None:
            return tmp, outcome.digest, outcome.error
        if limit < self.stall_deadline():  # the emergency deadline, not a stall
            write.abandon()
            return None, None, "emergency save deadline passed before commit"
        what = f"{STALLED}: the write of {write.path} did not finish within {limit:.1f}s"
        self._stalled(step, what, write)
        return None, None, what

    # -- background saves -------------------------------------------------------------------------
    @property
    def in_flight(self) -> int | None:
        """The step being written or published in the background on this rank, if any."""
        if self._inflight is not None:
            return self._inflight["step"]
        return self._publishing.step if self._publishing is not None else None

    def busy(self) -> bool:
        """Collective: is a save still in flight on any rank? (Ranks finish publishing at
        different times; they must agree before starting or skipping the next save.)"""
        return any(self.coll.all_gather(self.in_flight is not None))

    def start_async(self, state: TrainingState) -> float:
        """Snapshot this rank's state and write it in the background; returns the seconds training
        was blocked. Every rank starts at the same step; :meth:`poll_async` publishes it."""
        assert self.in_flight is None, "one tier-1 save in flight at most"
        step = state.step
        self._skip_if_stalled(step)
        t0 = time.perf_counter()
        tmp = self.store.layout.tmp_dir(step, self.attempt)
        entry: dict[str, Any] = {"step": step, "t0": t0, "tmp": tmp, "write": None, "error": None}
        try:
            entry["manifest"] = step_manifest(self.cfg, state, FORMAT, self.attempt, owner_rank=self.rank)
            fault = writer_fault(self.cfg.fault_tolerance.inject, self.rank, step)
            payload = self._payload(state)
            mode = self._async_mode()
            if self._keep_host_copy and mode == "fork":  # the thread writer's own copy serves instead
                entry["host_copy"] = copy.deepcopy(payload)
            # A snapshot kept as the host copy cannot share buffers with the next save.
            buffers = None if self._keep_host_copy else self._buffers
            expected = self._needed_bytes()

            def make_tmp_dir() -> None:  # in the writer: a mkdir can stall behind writeback
                self.publisher.begin(step, expected, lambda: self._make_room(step))

            entry["write"] = BackgroundWrite(
                mode,
                payload,
                tmp / STATE_FILE,
                fault,
                buffers,
                prepare=make_tmp_dir,
                hashing=self.hashing,
                slow_s=self.cfg.fault_tolerance.inject.writer_slow_seconds,
            )
        except (TieringError, OSError) as exc:  # storage said no; a bug (TypeError, ...) fails the attempt
            entry["error"] = str(exc)
        entry["blocked"] = time.perf_counter() - t0
        self._inflight = entry
        write = entry["write"]
        if self._record_event is not None and write is not None:
            self._record_event(
                "save_started", durable=False, tier="local", step=step, writer_pid=write.pid, blocked=entry["blocked"]
            )
        return entry["blocked"]

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        """Advance the save in flight; None while it is not finished on this rank (unless ``block``).

        Writing: collective (every rank, every step) until every rank's writer is done; then the
        commit, replication and retention run on a publisher thread (collectives on the
        replication group), off the training step. Returns the SaveResult once this rank has
        published; raises PublishError if any writer failed or died: the step is not committed
        and its temporary directory is gone, older steps are intact.
        """
        entry = self._inflight
        if entry is not None:
            write = entry["write"]
            outcome, status = self._writer_status(entry, block)
            statuses = self.coll.all_gather(status)
            stalled = next((f"rank {r}: {e}" for r, e in enumerate(statuses) if e.startswith(STALLED)), None)
            if stalled is not None:
                self._inflight = None
                if status.startswith(STALLED):
                    raise self._stalled(entry["step"], status, write)
                shutil.rmtree(entry["tmp"], ignore_errors=True)  # this rank's storage answers
                raise PublishError(f"step {entry['step']} is not complete in tier 1: {stalled}")
            if "running" in statuses:
                if not block:
                    return None
                raise AssertionError("a blocking poll cannot see a running writer")  # pragma: no cover
            self._inflight = None
            error = None if status == "ok" else status
            peer = next((f"rank {r}: {e}" for r, e in enumerate(statuses) if e != "ok"), None)
            digest = outcome.digest if outcome is not None else None
            blocked = entry["blocked"] + (write.snapshot_wait_seconds if write is not None else 0.0)
            host_copy = entry.get("host_copy") or (write.snapshot if write is not None else None)
            args = (entry["step"], entry["tmp"], entry.get("manifest"), error, entry["t0"], blocked, digest)
            self._publishing = _PublishInFlight(
                entry["step"],
                lambda: self._publish(*args, coll=self.replicator.coll, peer_error=peer),
                host_copy,
                entry["t0"],
            )
        job = self._publishing
        if job is None or not self._publish_ended(job, block):
            return None
        self._publishing = None
        result = job.result()  # raises the PublishError of a failed save
        self._slowest_s = max(self._slowest_s, time.perf_counter() - job.t0)
        if self._keep_host_copy and job.host_copy is not None:
            _HOST_COPIES[(self.run_id, self.rank)] = (job.step, job.host_copy)
        return result

    def _writer_status(self, entry: dict[str, Any], block: bool) -> tuple[Any, str]:
        """This rank's writer: its outcome (None while it runs) and its status for the other ranks:
        ``running``, ``ok``, the error, or ``stalled: ...`` once it ran past the stall deadline."""
        write = entry["write"]
        if write is None:
            return None, entry["error"] or "ok"
        deadline = self.stall_deadline()
        outcome = write.poll(block, timeout=max(0.0, deadline - (time.perf_counter() - entry["t0"])))
        if outcome is not None:
            return outcome, entry["error"] or outcome.error or "ok"
        if block or time.perf_counter() - entry["t0"] > deadline:
            return None, f"{STALLED}: the write of {write.path} did not finish within {deadline:.1f}s"
        return None, "running"

    def _publish_ended(self, job: _PublishInFlight, block: bool) -> bool:
        """Whether the background publish of ``job`` ended (``block``: wait for it, up to the
        stall deadline). Past the deadline it is abandoned (a daemon thread nothing joins) and the
        tier marked stalled: PublishError."""
        deadline = self.stall_deadline()
        if block:
            job.wait(max(0.0, deadline - (time.perf_counter() - job.t0)))
        if job.done():
            return True
        if not block and time.perf_counter() - job.t0 <= deadline:
            return False
        self._publishing = None
        what = f"{STALLED}: the commit and replication of step {job.step} did not finish within {deadline:.1f}s"
        raise self._stalled(job.step, what)

    def before_optimizer_step(self) -> float:
        """The optimizer is about to change the weights in place: a thread writer still copying
        them must finish first. Returns the seconds training waited (counted as blocked)."""
        entry = self._inflight
        if entry is None or entry["write"] is None:
            return 0.0
        return entry["write"].wait_for_snapshot()

    def poll_fits_in_step(self) -> bool:
        return True  # a status exchange: the commit and replication run on a publisher thread

    def abandon_async(self) -> None:
        """Leaving without publishing (an exception unwinds the loop): stop a fork writer; give
        a publish in flight the replication timeout to end (a lost peer fails it sooner)."""
        if self._inflight is not None and self._inflight["write"] is not None:
            self._inflight["write"].kill(wait_s=min(5.0, self.stall_deadline()))
        self._inflight = None
        if self._publishing is not None:
            self._publishing.wait(min(self.cfg.checkpoint.replication.timeout_s, self.stall_deadline()))
        self._publishing = None

    def finish_publishing(self) -> None:
        """Wait until a background publish is over: before a synchronous save (the same
        replication group; retention) or before moving steps out of the stores. Its outcome
        stays for :meth:`poll_async` to hand to the trainer, which reports it. A publish that
        does not end within the stall deadline marks the tier stalled (poll_async reports it)."""
        job = self._publishing
        if job is not None:
            job.wait(max(0.0, self.stall_deadline() - (time.perf_counter() - job.t0)))
            if not job.done() and self.health.mark_stalled(f"{STALLED}: the publish of step {job.step} hangs"):
                self._report_stall(f"the commit and replication of step {job.step} did not finish in time")

    def _async_mode(self) -> str:
        mode = self.cfg.checkpoint.async_.mode
        if mode != "auto":
            return mode
        # auto is fork on CPU: a write stuck in a stalled file system (uninterruptible in the
        # kernel) is then its own process, which never keeps the rank from exiting; a thread stuck
        # there would (docs/checkpoints.md, "Stalled storage"). Measured cost: 27 ms blocked per
        # 305 MB save vs 3.8 ms for thread, the same training time per save within noise (bench:
        # fork 0.89 s [0.52-1.20], thread 1.14 s [0.89-1.17]). Thread where a process must not
        # fork (CUDA initialised) and where in-process restarts keep the writer's copy as the host copy.
        return "thread" if torch.cuda.is_initialized() or self._keep_host_copy else "fork"

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
        if not self.agree_healthy():
            why = self.health.reason or "another rank's tier-1 storage is stalled"
            return PeerPlanResult(None, rejected=[f"{TIERS_SKIPPED}: {why}"])
        return self.recovery.recover()

    def load(self, restore: PeerRestore, state: TrainingState) -> None:
        if self.phases is not None:
            self.phases.enter("load")
        apply_payload(state, load_verified_state(restore.path / STATE_FILE), restore.path / STATE_FILE)

    def host_copy_step(self) -> int | None:
        """Step of this rank's host-memory copy, if it is still the committed step on disk (a
        stat, not a read: quarantined or superseded steps lose their copy's validity)."""
        entry = _HOST_COPIES.get((self.run_id, self.rank))
        if entry is None or not (self.store.step_path(entry[0]) / COMMITTED_NAME).is_file():
            return None
        return entry[0]

    def load_host_copy(self, state: TrainingState) -> None:
        step, cached = _HOST_COPIES[(self.run_id, self.rank)]
        # A copy: optimizers keep references to loaded tensors and update them in place.
        apply_payload(state, copy.deepcopy(cached), Path(f"<host-memory copy of step {step}>"))

    def step_bytes(self, step: int) -> int:
        return dir_size(self.store.step_path(step))


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
    disk): mapped, not read again (``mmap=True``), so the load costs no second pass over the bytes
    and no second copy in memory; tensors are paged in from the verified pages as they are used."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


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


class _PublishInFlight:
    """A background save's commit, replication and retention, on its own thread."""

    def __init__(self, step: int, publish: Any, host_copy: dict[str, Any] | None, t0: float) -> None:
        self.step = step
        self.host_copy = host_copy
        self.t0 = t0  # time.perf_counter() the save started (its deadline counts from there)
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(publish,), name=f"publish-{step}", daemon=True)
        self._thread.start()

    def _run(self, publish: Any) -> None:
        try:
            self._result = publish()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    def result(self) -> SaveResult:
        self._thread.join()
        if self._error is not None:
            if isinstance(self._error, PublishError):
                raise self._error
            if isinstance(self._error, (TieringError, OSError)):
                raise PublishError(f"step {self.step} not published: {one_line(self._error)}") from self._error
            raise self._error  # a programming error fails the attempt, never reads as a failed save
        assert self._result is not None
        return self._result
