"""Tier 0 (``checkpoint.memory``): each rank's newest state in memory-backed slot files.

Owns the tier-0 schedule (every ``interval`` steps), the background write of each snapshot straight
into the free slot in the raw layout of :mod:`pretrain.checkpointing.raw_payload` (on CPU writing
the live tensors' bytes into the tmpfs file *is* the snapshot: no host copy is made first; on GPU
the writer first copies them on a side stream, after an event recorded at the save, into one pinned
arena per dtype, and the optimizer step waits for that copy only), the seal once the chunk digests
are complete, the start-up memory check, turning the tier off when the tmpfs fills, and the tier-0
restore (agree on the newest step every rank can obtain from its own slots or from the peer copy its
tier-2 peer holds, verify its chunks, fetch the peer copies needed, map it). The slot files survive
the rank process and an ft_launcher restart; the peer copies (:mod:`tiering.memory.peer_slots`,
offered to the stream once every rank sealed a slot) survive the node.

Never: writes a disk, decides slot rotation itself (:mod:`tiering.memory.slots`), touches slot files other
than through :class:`tiering.memory.slot_store.SlotStore`, or orders restores across tiers
(:class:`pretrain.checkpointing.tiered.TieredCheckpointer` does). The checkpoint manager drives
saves through the :class:`pretrain.checkpointing.tier.CheckpointTier` protocol; every method that
takes or returns a save is collective, as for the other tiers.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpointing import raw_payload
from pretrain.checkpointing.async_writer import (
    SnapshotBuffers,
    WriterThread,
    copy_tensors,
    record_produced,
    snapshot_device,
    stage_with_devices,
)
from pretrain.checkpointing.memory_budget import (
    SHM_RESERVE_PER_RANK,
    NodeRoom,
    RankNeed,
    cgroup_free_bytes,
    missing_moment_bytes,
    node_budget,
    pinned_bytes,
)
from pretrain.checkpointing.rank_payload import FORMAT, apply_payload, load_verified_state, rank_payload
from pretrain.checkpointing.state import SaveResult, TrainingState, step_manifest
from pretrain.config import Config
from pretrain.errors import ConfigError
from tiering.collective import Collective
from tiering.digest import HashSpec
from tiering.errors import PublishError, UnsafeDirectory, VerificationError
from tiering.manifest import Manifest
from tiering.memory.peer_slots import Offer, PeerSlots, PeerStream
from tiering.memory.slot_store import SlotStore
from tiering.memory.slots import SlotView, common_step, loadable, newer_than, next_sequence, slot_to_write
from tiering.peer.transport import Transport
from tiering.system.private_dir import private_dir
from tiering.verify import VERIFY_THREADS, read_manifest

log = logging.getLogger(__name__)

# A slot's header (the non-tensor values, pickled) and the tensors' alignment, beyond their bytes
# (the tiny config: ~20 KB; this leaves room for a tokenizer identity, the trainer's records and
# 64 bytes of alignment for each of tens of thousands of tensors).
PAYLOAD_SLACK_BYTES = 4 * 1024 * 1024

# One writer thread per process for every tier-0 write: a write abandoned by an in-process restart
# finishes before the next incarnation's first write starts (never two writers on one slot).
_SLOT_WRITER = WriterThread()


class TierDisabled(PublishError):
    """Tier 0 turned itself off (its tmpfs is full): reported once as a warning; training and the
    other tiers go on, and it never stops the job (``checkpoint.on_save_error: stop`` included)."""


@dataclass
class _SlotWrite:
    """One snapshot being written into a slot by the writer thread."""

    step: int
    slot: int
    sequence: int
    t0: float
    blocked: float = 0.0
    nbytes: int = 0
    error: str | None = None
    full: bool = False  # the tmpfs ran out of space
    crash: BaseException | None = None  # a programming error: raised on the training thread
    done: threading.Event | None = None
    # Set once the live tensors are in host memory (on GPU: the device-to-host copy into the
    # pinned arena; on CPU serialising them into the slot is the copy, so with the seal).
    copied: threading.Event = field(default_factory=threading.Event)
    device: torch.device | None = None  # the GPU of the state, None on CPU
    host_copy: bool = False  # copied into the arena first, the optimizer step waiting for that only


@dataclass(frozen=True)
class Found:
    """The step every rank can load from tier 0, this rank's slot holding it, and where it came
    from (``memory``: its own slot; ``memory-peer``: fetched from the copy rank ``holder`` held)."""

    step: int
    slot: int
    tier: str = "memory"
    holder: int | None = None


class MemoryTier:
    name = "memory"
    within_step = True  # a tmpfs write the optimizer step waits for: judged by the step timeout

    def __init__(
        self, cfg: Config, coll: Collective, attempt: str, topology: dict[str, int], host_copy: bool | None = None
    ) -> None:
        """``host_copy``: copy the state into the arena before serialising it (None: on GPU only;
        True on CPU runs the GPU path's logic with CPU tensors and no stream: the tests)."""
        mem = cfg.checkpoint.memory
        self.cfg = cfg
        self.coll = coll
        self.rank = coll.rank
        self.attempt = attempt
        self.topology = topology
        self.interval = mem.interval
        self.peers: PeerSlots | None = None
        self._stream: PeerStream | None = None
        self.store = SlotStore(Path(mem.dir), cfg.run.id, coll.rank, mem.slots)
        integrity = cfg.checkpoint.integrity
        self.hashing = HashSpec(integrity.local_hash, integrity.chunk_bytes, integrity.hash_threads)
        self.enabled = True
        self._inflight: _SlotWrite | None = None
        self._sequence: int | None = None
        self._mapped: set[int] = set()  # slots a loaded state may still map: rewritten on a new inode
        self._agent_pins: frozenset[int] = frozenset()  # slots the node's agent is copying to tier 1
        self._buffers = SnapshotBuffers()  # on GPU: the pinned arena every snapshot is copied into
        self._host_copy = host_copy

    def attach_peers(self, holders: dict[int, list[int]], transport: Transport) -> None:
        """Stream each sealed slot to ``holders[rank]`` and hold the copies of the owners whose
        holder this rank is (both on the peer stream's own group: ``transport``)."""
        peers = PeerSlots(self.store, holders, transport, VERIFY_THREADS)
        self.peers = peers if peers.holders_of_mine or peers.owners_held else None
        if self.peers is not None and self.store.slots < 3:
            log.warning(
                "rank %d: tier-0 peer copy with checkpoint.memory.slots=%d: a send slower than one snapshot "
                "interval gives way to the own copy and the peer copy lags; fix: checkpoint.memory.slots: 3",
                self.rank, self.store.slots,
            )  # fmt: skip

    # -- the CheckpointTier protocol ---------------------------------------------------------------
    def due(self, step: int, final: bool) -> bool:
        return self.enabled and (final or step % self.interval == 0)

    @property
    def in_flight(self) -> int | None:
        return self._inflight.step if self._inflight is not None else None

    def busy(self) -> bool:
        """Is a snapshot in flight? The same answer on every rank without asking them: every rank
        starts a snapshot at the same step and :meth:`poll_async` ends it on every rank at once
        (one status exchange), so a collective here would only cost a round per step."""
        return self.in_flight is not None

    def prepare(self) -> None:
        """Nothing to clean: an unsealed slot is never loaded and is the next one written."""

    def save(self, state: TrainingState, deadline: float | None = None) -> SaveResult:
        """Collective, synchronous (``checkpoint.async.enabled: false``): write, seal, agree."""
        self.start_async(state)
        result = self.poll_async(block=True)
        assert result is not None
        return result

    def start_async(self, state: TrainingState) -> float:
        """Serialise this rank's state into the free slot on the tier-0 writer thread; returns
        the seconds training was blocked (staging the non-tensor values)."""
        assert self._inflight is None, "one tier-0 save in flight at most"
        if not self.enabled:  # turned off while the manager waited for the previous write
            return 0.0
        t0 = time.perf_counter()
        manifest = step_manifest(self.cfg.run.id, self.cfg.data, state, FORMAT, self.attempt, owner_rank=self.rank)
        return self.start_payload(state.step, rank_payload(state, self.rank), manifest, t0)

    def start_payload(self, step: int, payload: dict[str, Any], manifest: Manifest, t0: float) -> float:
        """:meth:`start_async` once the payload (live tensors) and manifest are built: claim the
        slot, stage, record the event the copy waits for, hand the write to the writer thread."""
        views = self.store.views()
        if self._sequence is None:
            self._sequence = next_sequence(views)
        job = _SlotWrite(step, self._claim_slot(views), self._sequence, t0)
        self._sequence += 1
        staged, devices = stage_with_devices(payload)
        job.device = snapshot_device(devices)
        job.host_copy = job.device is not None if self._host_copy is None else self._host_copy
        produced = record_produced(job.device)  # after the kernels that made this state (CUDA only)
        fresh = job.slot in self._mapped
        self._mapped.discard(job.slot)
        box = [staged]  # emptied by the writer once copied: nothing here keeps the live tensors
        del staged
        job.done = _SLOT_WRITER.submit(lambda: self._write(job, box, manifest, fresh, produced))
        job.blocked = time.perf_counter() - t0
        self._inflight = job
        return job.blocked

    def _claim_slot(self, views: list[SlotView]) -> int:
        """The slot to write: never the newest sealed one, nor the one the peer stream is sending
        while another slot qualifies (``slots: 3`` always leaves one)."""

        def choose(pinned: frozenset[int]) -> int:
            return slot_to_write(views, self.cfg.run.id, pinned | self._agent_pins)

        return self._stream.claim_slot_to_write(choose) if self._stream is not None else choose(frozenset())

    # -- what the agent tier asks (pretrain.checkpointing.agent_tier.SealedSlots) -----------------
    def sealed_slot(self, step: int) -> int | None:
        """This rank's slot sealed with ``step`` (its header alone is read: tmpfs)."""
        if self.sealing(step):
            return None
        found = [v for v in loadable(self.store.views(), self.cfg.run.id, step) if v.step == step]
        return found[0].index if found else None

    def sealing(self, step: int) -> bool:
        job = self._inflight
        return job is not None and job.step == step and job.done is not None and not job.done.is_set()

    def wait_sealed(self, timeout: float) -> None:
        job = self._inflight
        if job is not None and job.done is not None:
            job.done.wait(timeout)

    def pin(self, slots: frozenset[int]) -> None:
        self._agent_pins = slots

    def before_optimizer_step(self) -> float:
        """The optimizer is about to change the tensors being serialised. On CPU: wait until the
        slot is sealed. Waiting for the seal, not only for the payload, is what bounds the loss to
        one step: once step s+1 is reported done, step s is loadable (the digests of a slot take a
        fraction of the forward and backward they overlap). On GPU: wait for the device-to-host
        copy only (the state is then in the pinned arena); the write and seal finish behind the
        optimizer step, sealed before the next snapshot starts, so a crash inside that window
        loses one step more. Seconds waited."""
        job = self._inflight
        if job is None or job.done is None or job.done.is_set():
            return 0.0
        t0 = time.perf_counter()
        (job.copied if job.host_copy else job.done).wait()
        waited = time.perf_counter() - t0
        job.blocked += waited
        return waited

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        """Collective while a write is in flight: None until every rank sealed (unless ``block``).
        Raises TierDisabled on every rank when any rank's tmpfs filled (the tier is off from now
        on), PublishError when any rank's write failed otherwise (the next step tries again)."""
        job = self._inflight
        if job is None:
            return None
        assert job.done is not None
        if block:
            job.done.wait()
        status = "running" if not job.done.is_set() else ("full" if job.full else job.error or "ok")
        statuses = self.coll.all_gather(status)
        if "running" in statuses:
            if not block:
                return None
            raise AssertionError("a blocking poll cannot see a running tier-0 writer")  # pragma: no cover
        self._inflight = None
        if job.crash is not None:
            raise job.crash
        failed = [(r, s) for r, s in enumerate(statuses) if s != "ok"]
        if any(s == "full" for _, s in failed):
            self.enabled = False
            full = next(r for r, s in failed if s == "full")
            raise TierDisabled(
                f"tier 0 turned off at step {job.step}: rank {full}'s tmpfs {self.cfg.checkpoint.memory.dir} is full "
                f"({job.error if full == self.rank else 'no space left'}); training and tier 1 go on; fix: give the "
                "job more shared memory (--shm-size, emptyDir.sizeLimit) or lower checkpoint.memory.slots"
            )
        if failed:
            raise PublishError(f"step {job.step} not sealed in tier 0: rank {failed[0][0]}: {failed[0][1]}")
        seconds = time.perf_counter() - job.t0
        skipped = self._offer_to_peer(job)
        return SaveResult(
            self.name,
            job.step,
            seconds,
            job.nbytes,
            self.store.slot_dir(job.slot),
            blocked_seconds=job.blocked,
            peer_skipped=skipped,
        )

    def _offer_to_peer(self, job: _SlotWrite) -> int:
        """Every rank sealed ``job``'s slot: offer it to the peer stream (never waits, except for
        the final step, whose copy every rank finishes before the run ends). Returns the slots the
        stream skipped since the last call."""
        if self.peers is None:
            return 0
        if self._stream is None:
            self._stream = PeerStream(self.peers).start()
        self._stream.offer(Offer(job.step, job.slot, job.sequence))
        if job.step == self.cfg.train.steps:
            timeout = 4 * self.cfg.checkpoint.replication.timeout_s
            if not self._stream.close(drain=True, timeout=timeout):
                log.warning("rank %d: the final tier-0 peer copy did not finish within %ds", self.rank, timeout)
            skipped = self._stream.take_skipped()
            self._stream = None
            return skipped
        return self._stream.take_skipped()

    def poll_fits_in_step(self) -> bool:
        return True  # a status exchange and the seal, already waited for before the optimizer step

    def abandon_async(self) -> None:
        """Leaving after a failure: a tmpfs write cannot hang on a device, so let it finish (and
        seal: its state is complete) rather than leave a slot half-written behind. The peer
        stream drops the rounds it still owed (the job is failing; its peers time out)."""
        job, self._inflight = self._inflight, None
        if job is not None and job.done is not None:
            job.done.wait(timeout=60)
        if self._stream is not None:
            self._stream.close(drain=False, timeout=1.0)
            self._stream = None

    def _write(
        self, job: _SlotWrite, box: list[dict[str, Any]], manifest: Manifest, fresh_inode: bool, produced: Any
    ) -> None:
        """On the writer thread: (on GPU, the tensors copied into the pinned arena on a side
        stream after ``produced``, never a pageable copy of live device memory) payload into the
        slot, the chunk digests of the file, the seal."""
        try:
            try:
                if job.host_copy:  # on CPU (device None) the same copy, synchronous, into a plain arena
                    staged, _ = copy_tensors(box.pop(), self._buffers, job.device, produced)
                else:
                    staged = box.pop()
            finally:
                box.clear()
                if job.host_copy:
                    job.copied.set()
            # Hashed while written (hashing.threads lanes beside this thread): no second pass.
            write = functools.partial(raw_payload.write, staged)
            digest = self.store.write_hashed(job.slot, write, fresh_inode, self.hashing)
            job.nbytes = digest.size
            self.store.seal(job.slot, manifest, digest, job.sequence)
        except OSError as exc:
            job.error = f"{exc.filename or self.store.slot_dir(job.slot)}: {exc.strerror or exc}"
            job.full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        except Exception as exc:  # noqa: BLE001 - raised again on the training thread by poll_async
            job.crash = exc
        finally:
            job.copied.set()  # never leave the optimizer step waiting, even on failure

    # -- start-up --------------------------------------------------------------------------------
    def check_capacity(self, state: TrainingState) -> str | None:
        """Collective: the one line (sizes and fix), the same on every rank, saying why this node
        cannot hold tier 0 (a tmpfs without room for ``slots x (own + peer)`` state for every rank
        of the node that shares it, peer: the states of the ranks whose copies it holds; a job
        memory cgroup without room; no writable directory), or None once the snapshot arenas are
        reserved. An unsafe directory (not ours, a symlink) raises ConfigError on its rank."""
        root = Path(self.cfg.checkpoint.memory.dir)
        row: tuple[Any, ...] | str
        arenas: dict[torch.dtype, int] = {}
        try:
            private_dir(root / self.cfg.run.id)  # 0700, ours, not a symlink: tier 0 holds the model
            row, arenas = self._capacity_row(state, root)
        except UnsafeDirectory as exc:
            raise ConfigError(f"{self.cfg.source}: checkpoint.memory.dir: {exc}") from exc
        except OSError as exc:
            row = (
                f"{self.cfg.source}: checkpoint.memory.dir {root}: {exc.strerror or exc}; fix: point it at a "
                "writable tmpfs (/dev/shm) or set checkpoint.memory.enabled=false"
            )
        rows = self.coll.all_gather(row)
        failed = next((r for r in rows if isinstance(r, str)), None)
        if failed is not None:
            return failed
        where = rows[self.rank][0]
        sizes = [r[1] for r in rows]
        node = [r for r in rows if r[0] == where]
        needs = [RankNeed(r[1], sum(sizes[p] for p in r[4]), *r[5]) for r in node]
        frees = [r[6] for r in node if r[6] is not None]
        room = NodeRoom(
            tmpfs_free_bytes=min(r[2] for r in node),
            tier0_held_bytes=sum(r[3] for r in node),
            cgroup_free_bytes=min(frees) if frees else None,
            shm_reserve_bytes=SHM_RESERVE_PER_RANK * len(node) if node[0][7] else 0,
        )
        error = node_budget(needs, self.cfg.checkpoint.memory.slots, room).refusal(self.cfg.source, str(root))
        failed = next((e for e in self.coll.all_gather(error) if e), None)
        if failed is None:
            self.reserve_arenas(arenas, pin=torch.cuda.is_available())  # once the node was found to hold them
        return failed

    def _capacity_row(self, state: TrainingState, root: Path) -> tuple[tuple[Any, ...], dict[torch.dtype, int]]:
        """What this rank needs of its node and what it sees there (statvfs of ``root``), and the
        snapshot arenas by dtype it will reserve."""
        st = os.statvfs(root)
        where = (socket.gethostname(), os.stat(root).st_dev)
        payload = rank_payload(state, self.rank)
        # After the first step (GPU optimizers create Adam's moments lazily); host memory a write takes on CUDA.
        own = tensor_bytes(payload) + PAYLOAD_SLACK_BYTES + missing_moment_bytes(state.optimizer)
        cuda = torch.cuda.is_available()
        arenas = dtype_bytes(payload)  # one pinned arena per dtype; the moments to come are fp32
        arenas[torch.float32] = arenas.get(torch.float32, 0) + missing_moment_bytes(state.optimizer)
        host = (0, 2 * pinned_bytes(arenas.values())) if cuda else (0, 0)  # tier 0's and tier 1's, as allocated
        owners = self.peers.owners_held if self.peers is not None else []
        held = self.store.held_bytes() + (self.peers.held_bytes() if self.peers is not None else 0)
        on_shm = cuda and Path("/dev/shm").is_dir() and os.stat(root).st_dev == os.stat("/dev/shm").st_dev  # NCCL's
        return (where, own, st.f_bavail * st.f_frsize, held, owners, host, cgroup_free_bytes(), on_shm), arenas

    def reserve_arenas(self, by_dtype: dict[torch.dtype, int], pin: bool) -> None:
        """At start-up, where snapshots are copied first (on GPU; ``host_copy``): allocate the arena
        for ``by_dtype`` (bytes, after the first step) now, not inside the first saving step."""
        if self._host_copy or (self._host_copy is None and pin):
            self._buffers.reserve({d: -(-b // d.itemsize) for d, b in by_dtype.items()}, pin)

    # -- restore ---------------------------------------------------------------------------------
    def find_restorable(self, floor: int, suspect: set[int]) -> tuple[Found | None, list[tuple[int, str]]]:
        """Collective: the newest step every rank can obtain from tier 0, from its own sealed slot
        or else from the copy its peer holds, no older than ``floor`` and not suspect. Own slots
        are verified chunk by chunk on every rank (a bad one is quarantined); a rank without a good
        own slot has the peer copy sent over and checked (:meth:`PeerSlots.fetch`). Where a step
        fails for any rank the ranks agree on the next one: ``(found, rejected)``."""
        own = loadable(self.store.views(), self.cfg.run.id, floor, suspect)
        held = self.peers.held_steps(floor, suspect) if self.peers is not None else {}
        rows = self.coll.all_gather(([v.step for v in own], held))
        copies: dict[int, dict[int, set[int]]] = {}  # owner -> holder -> steps it holds
        for holder, (_, by_owner) in enumerate(rows):
            for owner, steps in by_owner.items():
                copies.setdefault(int(owner), {})[holder] = set(steps)
        rejected: list[tuple[int, str]] = []
        dropped: set[int] = set()
        while True:
            step = common_step([_obtainable(set(r[0]), copies.get(n, {})) - dropped for n, r in enumerate(rows)])
            if step is None:
                return None, rejected
            found, reason = self._obtain(step, own, copies)
            reasons = self.coll.all_gather(reason)
            if not any(reasons):
                assert found is not None
                return found, rejected
            rejected += [(step, f"rank {r}: tier 0: {e}") for r, e in enumerate(reasons) if e]
            dropped.add(step)

    def _obtain(
        self, step: int, own: list[SlotView], copies: dict[int, dict[int, set[int]]]
    ) -> tuple[Found | None, str | None]:
        """Collective: this rank's slot of ``step``, its own (verified) or fetched from a peer."""
        slot = next((v.index for v in own if v.step == step and self.store.view(v.index) == v), None)
        reason = self._check_slot(slot) if slot is not None else "no sealed own slot"
        needs = self.coll.all_gather(reason is not None)
        plan = {}
        for owner, need in enumerate(needs):
            holders = sorted(h for h, steps in copies.get(owner, {}).items() if step in steps)
            if need and holders:
                plan[owner] = holders[0]
            elif need:
                return None, reason if owner == self.rank else None
        if not plan:
            return Found(step, slot) if slot is not None else None, reason
        assert self.peers is not None, "a peer copy is planned only where peers are attached"
        outcome = self.peers.fetch(step, plan)
        if self.rank not in plan:
            return Found(step, slot) if slot is not None else None, outcome.error
        if outcome.slot is None:
            return None, f"{reason}; {outcome.error}" if slot is not None else outcome.error
        topology = self._topology_error(outcome.slot)
        return Found(step, outcome.slot, "memory-peer", plan[self.rank]), topology

    def _check_slot(self, slot: int) -> str | None:
        """Why this rank cannot load ``slot`` (None: every chunk verified, same topology)."""
        try:
            manifest = self.store.verify(slot, VERIFY_THREADS)
        except VerificationError as exc:
            reason = str(exc)
            moved = self.store.quarantine(slot, reason)
            log.warning("rank %d: tier-0 slot rejected and moved to %s: %s", self.rank, moved, reason)
            return reason
        except OSError as exc:
            return f"{exc.filename or self.store.slot_dir(slot)}: {exc.strerror or exc}"
        return self._topology_error(slot, manifest)

    def _topology_error(self, slot: int, manifest: Manifest | None = None) -> str | None:
        """Why a verified slot was saved at another topology (None: this one)."""
        try:
            manifest = manifest or read_manifest(self.store.slot_dir(slot))
        except (VerificationError, OSError) as exc:
            return str(exc)
        parallelism = {k: v for k, v in self.topology.items() if k != "world_size"}
        if manifest.world_size != self.topology["world_size"] or manifest.parallelism != parallelism:
            return f"{self.store.slot_dir(slot)}: saved at another topology ({manifest.world_size} ranks)"
        return None

    def load(self, slot: int, state: TrainingState) -> Path:
        """Map the verified slot file (no second copy) and load it into ``state``."""
        path = self.store.state_path(slot)
        apply_payload(state, load_verified_state(path), path)
        self._mapped.add(slot)
        return path

    def invalidate_newer(self, step: int) -> list[int]:
        """Unseal slots newer than the step the run resumes from (an abandoned timeline), the
        peer copies held here included; returns the own slots unsealed."""
        newer = newer_than(self.store.views(), self.cfg.run.id, step)
        for index in newer:
            self.store.invalidate(index)
        for held in self.peers.invalidate_newer(step) if self.peers is not None else []:
            log.warning("rank %d: tier-0 peer copy %s superseded: the run resumed from step %d", self.rank, held, step)
        return newer

    def invalidate_step(self, step: int) -> None:
        """Unseal every slot holding ``step``, own or held for a peer (a suspect step: never
        restored again)."""
        stores = [self.store, *(self.peers.held.values() if self.peers is not None else [])]
        for store in stores:
            for view in store.views():
                if view.step == step and view.run_id == self.cfg.run.id:
                    store.invalidate(view.index)


def _obtainable(own: set[int], held_by: dict[int, set[int]]) -> set[int]:
    """Steps a rank can load from tier 0: its own sealed slots and every copy a peer holds of it."""
    out = set(own)
    for steps in held_by.values():
        out |= steps
    return out


def tensor_bytes(payload: Any) -> int:
    """Bytes of every tensor in a payload (what a slot holds, less the pickle framing)."""
    return sum(dtype_bytes(payload).values())


def dtype_bytes(payload: Any) -> dict[torch.dtype, int]:
    """Bytes of a payload's tensors by dtype (what each snapshot arena holds)."""
    total: dict[torch.dtype, int] = {}
    stack: list[Any] = [payload]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            total[v.dtype] = total.get(v.dtype, 0) + v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total
