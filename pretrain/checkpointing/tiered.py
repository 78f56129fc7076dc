"""When each tier saves, and the recovery order: own tier 0 (memory) -> the peer's tier 0 -> own
local copy -> peer replica -> reshardable tier -> S3; the newest step every rank can obtain wins."""

from __future__ import annotations

import datetime
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from pretrain.checkpointing.agent.client import AgentLink, spec_for
from pretrain.checkpointing.agent_tier import AgentTier
from pretrain.checkpointing.memory_tier import MemoryTier
from pretrain.checkpointing.per_rank import TIERS_SKIPPED, PerRankCheckpoints
from pretrain.checkpointing.per_rank_assembly import build_per_rank_checkpoints
from pretrain.checkpointing.reshardable import ReshardableCheckpoints
from pretrain.checkpointing.run_key_source import load_run_key
from pretrain.checkpointing.state import RestoreResult, TrainingState
from pretrain.checkpointing.tier import CheckpointTier
from pretrain.checkpointing.tiering_config import suspects_path
from pretrain.config import CheckpointConfig, Config, s3_owner
from pretrain.errors import ConfigError, FreshStartRefused
from pretrain.resilience.phases import PhaseRecord
from tiering.collective import Collective, TorchCollective
from tiering.digest import PORTABLE_HASH
from tiering.errors import LeaseError
from tiering.peer.restore import PeerPlanResult, PeerRestore
from tiering.peer.transport import Transport
from tiering.remote.objectstore import ObjectStoreError, open_store  # boto3 itself loads only for s3:// URIs
from tiering.remote.tier import RemoteTier
from tiering.system.fsio import atomic_write_bytes
from tiering.trust.signature import ManifestSigner

log = logging.getLogger(__name__)

# Tier 0's peer stream sends in 16 MiB pieces: its buffers (3 to send, 3 per owner received from)
# stay ~100 MiB per rank beside tier 0's own slots, where tier 1's 64 MiB pieces would take ~400.
PEER_PIECE = 16 * 1024 * 1024


class TieredCheckpointer:
    def __init__(
        self,
        cfg: Config,
        coll: Collective,
        attempt: str,
        topology: dict[str, int],
        record_event: Callable[..., None] | None = None,
        phases: PhaseRecord | None = None,
    ) -> None:
        self.phases = phases
        self._unusable: list[str] = []  # why copies found during the last restore could not be used
        self.cfg = cfg
        self.coll = coll
        self.local: PerRankCheckpoints | None = None
        self.reshardable: ReshardableCheckpoints | None = None
        self._staging: ReshardableCheckpoints | None = None  # the reshardable tier, if it answers (per restore)
        self._staging_note: str | None = None  # why the restore left the reshardable tier alone
        self._record_event = record_event
        wanted = cfg.checkpoint.memory.enabled is not False  # true, or auto (decided in prepare)
        self.memory = MemoryTier(cfg, coll, attempt, topology) if wanted else None
        self._memory_rejected: list[tuple[int, str]] = []
        self.attempt = attempt
        # The run key tags every transfer between ranks and signs every staging/S3 manifest.
        self._run_key = load_run_key(cfg.checkpoint.integrity, cfg.run, coll) if self._keyed(cfg.checkpoint) else None
        signer = ManifestSigner(self._run_key) if self._run_key is not None else None
        # The lease first: a job that may not write this run fails before anything else starts.
        self.remote = self._open_remote(signer) if cfg.checkpoint.s3.uri else None
        if cfg.checkpoint.local.enabled:
            assert self._run_key is not None  # _keyed: tier 1 is on
            # Replication gets its own gloo group so that its waits are bounded independently of
            # the training group (which may be NCCL on GPUs).
            group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=cfg.checkpoint.replication.timeout_s)
            )
            transport = Transport(group, cfg.checkpoint.replication.timeout_s, key=self._run_key)
            self.local = build_per_rank_checkpoints(
                cfg, coll, attempt, topology, transport, TorchCollective(group), record_event, phases
            )
        if cfg.checkpoint.reshardable.enabled:
            self.reshardable = ReshardableCheckpoints(
                cfg, coll, attempt, record_event=record_event, phases=phases, signer=signer
            )
        if self.memory is not None and self.local is not None:
            self._attach_memory_peers()
        self.agent: AgentTier | None = None
        if cfg.checkpoint.agent.enabled and self.memory is not None and self.local is not None:
            self.agent = self._agent_tier(self.memory, self.local)

    def _agent_tier(self, memory: MemoryTier, local: PerRankCheckpoints) -> AgentTier:
        """Tier 1 through the node's agent: the rank asks it to persist tier 0's sealed slots."""
        ck = self.cfg.checkpoint
        spec = spec_for(self.cfg.run, ck, self.cfg.fault_tolerance.hang_watch_s)
        if ck.memory.slots < 3 and self.coll.rank == 0:
            log.warning(
                "tier 1 through the agent with checkpoint.memory.slots=%d: a snapshot may overwrite the slot the "
                "agent copies (that save then fails as torn); fix: checkpoint.memory.slots: 3",
                ck.memory.slots,
            )
        link = AgentLink(spec, ck.agent.timeout_s)
        return AgentTier(
            self.coll,
            ck.local.interval,
            memory,
            link,
            local,
            local.storage.deadline(),
            local.store.layout.steps_dir,
            self.cfg.train.steps,
        )

    @property
    def tier1(self) -> CheckpointTier | None:
        """Tier 1 as the trainer saves to it: through the node's agent, or in-process (also once tier
        0 turned itself off, a full tmpfs: the agent persists tier 0's snapshots)."""
        tier0_on = self.memory is not None and self.memory.enabled
        if self.agent is not None and (tier0_on or self.agent.in_flight is not None):
            return self.agent
        return self.local

    def _attach_memory_peers(self) -> None:
        """Tier 0's peer copy goes to the rank's tier-2 holders on another node (a copy on the
        same node does not survive what tier 0 alone does not). Collective: the stream gets its
        own gloo group, so its background sends never interleave with training's collectives."""
        assert self.memory is not None and self.local is not None
        rep = self.cfg.checkpoint.replication
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=rep.timeout_s))
        node = {i.rank: i.node for i in self.local.identities}
        holders = {o: [h for h in hs if node[h] != node[o]] for o, hs in self.local.holders.items()}
        self.memory.attach_peers(holders, Transport(group, rep.timeout_s, piece=PEER_PIECE, key=self._run_key))

    @staticmethod
    def _keyed(ckpt: CheckpointConfig) -> bool:
        """Whether a tier that moves or signs steps is on (every one but tier 0 alone)."""
        return bool(ckpt.local.enabled or ckpt.reshardable.enabled or ckpt.s3.uri)

    def _open_remote(self, signer: ManifestSigner | None) -> RemoteTier:
        """Rank 0 checks the run lease at start: another owner fails the job now, an unreachable
        store only warns (the uploader, not the trainer, writes to it). Its steps are read only
        with a signature that verifies and blake3 digests."""
        s3 = self.cfg.checkpoint.s3
        store, prefix = open_store(
            s3.uri, s3.endpoint_url, s3.concurrency, s3.multipart_chunk_mb, s3.checksum_header,
            s3.connect_timeout_s, s3.read_timeout_s, max_attempts=2,
        )  # fmt: skip
        remote = RemoteTier(store, prefix, self.cfg.run.id, s3.concurrency, signer=signer, expect_hash=PORTABLE_HASH)
        error = None
        if self.coll.rank == 0:
            try:
                remote.acquire_lease(s3_owner(self.cfg))
            except LeaseError as exc:
                error = str(exc)
            except ObjectStoreError as exc:
                log.warning("S3 tier unreachable at start (%s); training continues, the uploader retries", exc)
        error = self.coll.broadcast(error)
        if error:
            raise LeaseError(error)
        return remote

    # -- suspect (poisoned) steps ----------------------------------------------------------------
    @property
    def _suspect_path(self) -> Path:
        return suspects_path(self.cfg.run)

    def suspect_steps(self) -> set[int]:
        """Steps that verified but produced NaN/Inf right after a restore: never restored again."""
        try:
            return {int(s) for s in json.loads(self._suspect_path.read_text(encoding="utf-8"))}
        except (OSError, ValueError, TypeError):
            return set()

    def quarantine_everywhere(self, step: int, reason: str) -> list[str]:
        """Collective: move ``step`` out of every tier (own copies, replicas held, the reshardable
        tier) and record it as suspect, so that no tier, S3 included, restores it again."""
        moved: list[str] = []
        if self.memory is not None:
            self.memory.invalidate_step(step)
        if self._local_answers():
            self.local.finish_publishing()  # its retention must not race the moves below
            stores = self.local.stores()
            moved += [str(p) for p in (store.quarantine(step, reason) for store in stores) if p]
        if self.coll.rank == 0:
            if self.reshardable is not None and self.reshardable.storage.healthy:
                path = self.reshardable.tier.quarantine(step, reason)
                if path is not None:
                    moved.append(str(path))
            self._write_suspects(self.suspect_steps() | {step})
        self.coll.barrier()
        return moved

    def _write_suspects(self, steps: set[int]) -> None:
        self._suspect_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self._suspect_path, json.dumps(sorted(steps)).encode())

    def _local_answers(self) -> bool:
        """Whether this rank may touch its tier-1 storage now (enabled, and not stalled: a
        listing or rename there would block in the kernel for as long as it stalls)."""
        return self.local is not None and self.local.storage.healthy

    def prepare(self, state: TrainingState | None = None) -> None:
        """Clean what earlier attempts left; with ``state``, check the node holds tier 0: if not,
        refuse to start (``checkpoint.memory.enabled: true``) or go on without it (``auto``)."""
        if self.memory is not None and state is not None:
            refusal = self.memory.check_capacity(state)
            if refusal is not None:
                self._without_tier0(refusal)
        for tier in (self.local, self.reshardable):
            if tier is not None:
                tier.prepare()

    def _without_tier0(self, refusal: str) -> None:
        """Every rank got the same ``refusal``: with ``auto`` this run goes on without tier 0 (and
        without the agent, which persists tier 0's slots), saying why once; else it cannot start."""
        if self.cfg.checkpoint.memory.enabled is True:
            raise ConfigError(refusal)
        if self.coll.rank == 0:
            log.warning("tier 0 off (checkpoint.memory.enabled: auto): %s", refusal)
        if self._record_event is not None:
            self._record_event("tier0_off", reason=refusal)
        self.memory = None
        self.agent = None
        if self.local is not None:
            self.local.without_tier0()

    def due(self, step: int) -> list[CheckpointTier]:
        final = step == self.cfg.train.steps
        return [tier for tier in self.background_tiers() if tier.due(step, final)]

    def planned_intervals(self) -> dict[str, int]:
        """Steps between saves of each tier the trainer commits (for the staleness alert)."""
        out = {}
        if self.local is not None:
            out["local"] = self.cfg.checkpoint.local.interval
        if self.reshardable is not None:
            out["reshardable"] = self.cfg.checkpoint.reshardable.interval
        return out

    def background_tiers(self) -> list[CheckpointTier]:
        """The tiers the trainer saves to, in order (tier 0, tier 1, then promotion staging); all
        can save in the background."""
        return [t for t in (self.memory, self.tier1, self.reshardable) if t is not None]

    def before_optimizer_step(self) -> float:
        """Seconds waited for background snapshots of the weights about to change."""
        waited = self.memory.before_optimizer_step() if self.memory is not None else 0.0
        tier1 = self.local if self.tier1 is self.local else None  # the agent copies sealed slots only
        return waited + (tier1.before_optimizer_step() if tier1 is not None else 0.0)

    def in_flight_count(self) -> int:
        return sum(t.in_flight is not None for t in self.background_tiers())

    def stall_deadline_s(self) -> float:
        """Collective: the longest stall deadline of the tiers that have one (tier 1's grows with
        this rank's slowest save: the largest over the ranks); tier 0 writes to memory, and has none."""
        deadlines = [0.0]
        if self.local is not None:
            deadlines.append(self.local.storage.deadline())
        if self.reshardable is not None:
            deadlines.append(self.reshardable.storage.deadline())
        if self.agent is not None:
            deadlines.append(self.agent.stall_deadline_s)
        return max(self.coll.all_gather(max(deadlines)))

    def committed(self, step: int) -> None:
        """A save of ``step`` was published (in the foreground or the background)."""
        if self.coll.rank == 0 and step in self.suspect_steps():
            # A later attempt committed this step again from good state: it is no longer suspect.
            self._write_suspects(self.suspect_steps() - {step})

    def restore(self, state: TrainingState) -> RestoreResult | None:
        """Collective. Newest verified step wins (at equal steps the faster tier); steps newer than
        it in tiers 1-2 and staging are then superseded (see :meth:`_supersede_newer`)."""
        self._unusable: list[str] = []
        self._memory_rejected = []
        self._staging = self._reshardable_answering()
        result = self._restore(state)
        if result is not None and not result.tier.startswith("memory") and self._memory_rejected:
            result.rejected = self._memory_rejected + result.rejected
        if result is None and not self.cfg.checkpoint.allow_fresh_start:
            self._refuse_fresh_start()  # before superseding: it would quarantine what it names
        self._supersede_newer(result.step if result is not None else 0)
        return result

    def _reshardable_answering(self) -> ReshardableCheckpoints | None:
        """Collective: the reshardable tier, unless its storage is stalled on some rank: then this
        restore (the S3 download into its staging area included) and the superseding after it
        leave it alone, and the restore's notes say why."""
        self._staging_note = None
        if self.reshardable is None:
            return None
        self._staging_note = self.reshardable.stalled_note()
        if self._staging_note is not None:
            self._unusable.append(self._staging_note)
            if self.coll.rank == 0:
                log.warning("%s; the restore uses the other tiers", self._staging_note)
            return None
        return self.reshardable

    def _refuse_fresh_start(self) -> None:
        """Collective: raise FreshStartRefused on every rank if any tier holds committed steps of
        this run although no step could be obtained by every rank."""
        where = self.local.committed_inventory() if self._local_answers() else []
        if self.coll.rank == 0 and self._staging is not None:
            steps = self._staging.tier.committed_steps()
            if steps:
                where.append(f"reshardable {self._staging.tier.layout.run_dir} steps {steps}")
        elif self.coll.rank == 0 and self._staging_note is not None:
            # It may hold the run's steps, and cannot be asked: never a silent start from step 0.
            where.append(f"reshardable {self.reshardable.tier.layout.run_dir} (not listed: its storage is stalled)")
        if self.coll.rank == 0 and self.remote is not None:
            # Only a store that answered and listed nothing allows a fresh start: an unreachable one
            # (endpoint, network, credentials) may hold every step of the run.
            steps, unlisted = self.remote.committed_or_unlisted()
            if unlisted is not None:
                where.append(unlisted)
                self._unusable.append("S3 unreachable (see above)")
            if steps:
                where.append(f"{self.remote.where(self.remote.base)} steps {steps}")
        found = sorted({w for part in self.coll.all_gather(where) for w in part})
        why = [w for part in self.coll.all_gather(self._unusable) for w in part]
        if not found:
            return
        shown = "; ".join(found[:6]) + (f"; and {len(found) - 6} more" if len(found) > 6 else "")
        reason = why[0] if why else "no step has a copy for every rank (a node or volume is missing)"
        raise FreshStartRefused(
            f"run {self.cfg.run.id} has committed checkpoints but no step can be obtained by every rank: {shown}; "
            f"why: {reason}; fix: bring back the node, volume or S3 prefix that holds the missing copies, or set "
            "checkpoint.allow_fresh_start=true to start this run from step 0"
        )

    def _supersede_newer(self, step: int) -> None:
        """Steps newer than the one the run resumes from belong to an abandoned timeline (they did not
        verify, or some rank's part is gone). Published steps are immutable, so they would block the
        new timeline from publishing those step numbers: move them to quarantine, with the reason."""
        reason = f"superseded: attempt {self.attempt} resumed from step {step}"
        if self.memory is not None:
            for slot in self.memory.invalidate_newer(step):
                log.warning("rank %d: tier-0 slot %d %s", self.coll.rank, slot, reason)
        stores = []
        if self._local_answers():
            stores = self.local.stores()
        if self._staging is not None and self.coll.rank == 0:
            stores.append(self._staging.tier)
        for store in stores:
            for newer in (s for s in store.step_dirs() if s > step):
                store.quarantine(newer, reason)
                log.warning("rank %d: %s: step %d %s", self.coll.rank, store.layout.run_dir, newer, reason)

    def _restore(self, state: TrainingState) -> RestoreResult | None:
        t0 = time.perf_counter()
        memory = self._restore_from_memory(state, t0)
        if memory is not None:
            return memory
        host = self._restore_from_host(state, t0)
        if host is not None:
            return host
        notes: list[str] = [self._staging_note] if self._staging_note is not None else []
        plan = self.local.plan_restore() if self.local is not None else None
        if plan is not None and plan.skipped_topology:
            notes.append(
                f"tier 1-2 copies saved at another topology are not loadable here, using the reshardable "
                f"tier: {plan.skipped_topology[0]}"
            )
            self._unusable.append(f"saved at another topology: {plan.skipped_topology[0]}")
            if self.coll.rank == 0:
                log.warning(notes[-1])
        if plan is not None:
            self._unusable.extend(plan.rejected)
            notes += [r for r in plan.rejected if r.startswith(TIERS_SKIPPED)]  # stalled storage
        peer = plan.restore if plan is not None else None
        newest_reshardable = self._staging.newest_committed() if self._staging is not None else None
        from_s3 = self._fetch_from_s3(max(peer.step if peer else -1, newest_reshardable or -1), notes)
        if from_s3 is not None:
            newest_reshardable = from_s3
        if peer is not None and (newest_reshardable is None or newest_reshardable <= peer.step):
            return self._load_peer(peer, plan, state, t0, notes)
        rejected: list[tuple[int, str]] = []
        if self._staging is not None:
            # Only a step newer than the tier 1-2 one is worth a reshardable load; at equal steps
            # the per-rank copy is faster and carries every rank's exact state.
            result = self._staging.restore(
                state,
                newer_than=peer.step if peer else -1,
                rejected=rejected,
                exclude=frozenset(self.suspect_steps()) if self.coll.rank == 0 else frozenset(),
            )
            self._unusable.extend(reason for _, reason in rejected)
            if result is not None:
                result.notes = notes
                if from_s3 is not None and result.step == from_s3:
                    result.tier = "s3"
                return result
        if peer is not None:  # the reshardable tier had nothing newer that verified
            return self._load_peer(peer, plan, state, t0, notes, rejected)
        return None

    def _newest_on_disk(self) -> int:
        """Collective: the newest committed, unsuspected step in any rank's tier 1 or in the
        reshardable tier (-1 for none): tier 0 is used only when it holds that step or a newer one."""
        suspects = self.suspect_steps()
        mine = self.local.store.committed_steps() if self._local_answers() else []
        newest = [s for s in mine if s not in suspects][:1]
        if self._staging is not None:
            newest.append(self._staging.newest_committed() or -1)
        return max(self.coll.all_gather(max(newest, default=-1)))

    def _restore_from_memory(self, state: TrainingState, t0: float) -> RestoreResult | None:
        """Collective: the newest step every rank holds in a sealed, verified tier-0 slot, if no
        other tier has a newer one; loaded by mapping the verified file (no disk read)."""
        if self.memory is None:
            return None
        floor = self._newest_on_disk()
        found, self._memory_rejected = self.memory.find_restorable(floor, self.suspect_steps())
        if found is None:
            return None
        step = found.step
        verify_s = time.perf_counter() - t0
        if self.phases is not None:
            self.phases.enter("load")
        path = self.memory.load(found.slot, state)
        seconds = round(time.perf_counter() - t0, 4)
        source = str(path) if found.holder is None else f"rank {found.holder}'s tier 0 -> {path}"
        row = {"rank": self.coll.rank, "tier": found.tier, "source": source, "step": step, "seconds": seconds}
        per_rank = self.coll.all_gather(row)
        self.coll.barrier()
        tier = "memory" if all(r["tier"] == "memory" for r in per_rank) else "memory-peer"
        fetched = [r["rank"] for r in per_rank if r["tier"] != "memory"]
        where = f"tier 0 (memory; ranks {fetched} from their peer's copy)" if fetched else "tier 0 (memory)"
        note = f"step {step} restored from {where} on every rank; tier 1's newest was {floor}"
        return RestoreResult(
            tier,
            step,
            time.perf_counter() - t0,
            verify_s,
            True,
            self._memory_rejected,
            path.parent,
            per_rank,
            [note],
        )

    def _restore_from_host(self, state: TrainingState, t0: float) -> RestoreResult | None:
        """Collective: after an in-process restart, every rank still holds the newest committed
        tier-1 step in memory; if no tier has anything newer on disk, load it without any read."""
        if self.local is None:
            return None
        answers = self._local_answers()
        mine = self.local.host_copy_step() if answers else None
        newest = self.local.store.committed_steps()[:1] if answers else []
        if self._staging is not None:
            newest.append(self._staging.newest_committed() or -1)
        on_disk = max(newest, default=-1)
        rows = self.coll.all_gather((mine, on_disk))
        if mine is None or any(m != mine for m, _ in rows) or max(d for _, d in rows) > mine:
            return None
        self.local.load_host_copy(state)
        self.coll.barrier()
        return RestoreResult(
            "memory",
            mine,
            time.perf_counter() - t0,
            0.0,
            True,
            [],
            self.local.store.step_path(mine),
            [],
            [f"step {mine} restored from host memory (in-process restart); no disk read"],
        )

    def _fetch_from_s3(self, best_local: int, notes: list[str]) -> int | None:
        """Collective: if the object store has a newer committed step than every local tier, every
        rank downloads and verifies a share of its files into the reshardable tier (falling back to
        older S3 steps together): no rank waits alone behind rank 0's whole download."""
        if self.remote is None or self._staging is None:
            if self.remote is not None:
                notes.append("S3 not consulted: its steps are restored through the reshardable tier, which is stalled")
            return None
        suspects = self.suspect_steps() if self.coll.rank == 0 else set()
        newer = None
        if self.coll.rank == 0:
            try:
                committed = [s for s in self.remote.committed_steps() if s not in suspects]
                newer = bool(committed and committed[0] > best_local)
            except ObjectStoreError as exc:
                notes.append(f"S3 tier unreachable during restore: {exc}")
                log.warning(notes[-1])
        newer, best_local, suspects = self.coll.broadcast((newer, best_local, suspects))  # rank 0's view
        if not newer:
            return None
        try:
            layout = self._staging.tier.layout
            got, rejected = self.remote.restore_newest(layout, self.attempt, exclude=suspects, coll=self.coll)
        except ObjectStoreError as exc:  # every rank raises it (the download agrees on failures)
            notes.append(f"S3 tier unreachable during restore: {exc}")
            log.warning(notes[-1])
            return None
        for step, reason in rejected:
            notes.append(f"S3 step {step} rejected: {reason}")
        if got is not None and got <= best_local:
            return None
        if got is not None:
            notes.append(f"downloaded and verified step {got} from {self.remote.where(self.remote.base)}")
            log.info(notes[-1])
        return got

    def _load_peer(
        self,
        peer: PeerRestore,
        plan: PeerPlanResult,
        state: TrainingState,
        t0: float,
        notes: list[str],
        rejected_elsewhere: list[tuple[int, str]] | None = None,
    ) -> RestoreResult:
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
        rejected = [(_step_named(r, peer.step), r) for r in plan.rejected] + list(rejected_elsewhere or [])
        self.coll.barrier()
        return RestoreResult(
            tier, peer.step, time.perf_counter() - t0, peer.seconds, True, rejected, peer.path, per_rank, notes
        )


def _step_named(reason: str, default: int) -> int:
    """The step a rejection reason is about (its path names ``step-NNNNNNNNN``)."""
    m = re.search(r"step-(\d+)", reason)
    return int(m.group(1)) if m else default
