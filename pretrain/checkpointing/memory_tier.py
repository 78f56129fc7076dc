"""Tier 0 (``checkpoint.memory``): each rank's newest state in memory-backed slot files.

Owns the tier-0 schedule (every ``interval`` steps), the background write of each snapshot
straight into the free slot (serialising the live tensors into the tmpfs file *is* the snapshot:
no host copy is made first), the seal once the chunk digests are complete, the start-up memory
check, turning the tier off when the tmpfs fills, and the tier-0 restore (agree on the newest step
every rank holds, verify its chunks, map it). The slot files survive the rank process and an
ft_launcher restart; they do not survive the node.

Never: writes a disk, decides slot rotation itself (:mod:`tiering.slots`), touches slot files other
than through :class:`tiering.slot_store.SlotStore`, or orders restores across tiers
(:class:`pretrain.checkpointing.tiered.TieredCheckpointer` does). The checkpoint manager drives
saves through the :class:`pretrain.checkpointing.tier.CheckpointTier` protocol; every method that
takes or returns a save is collective, as for the other tiers.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpointing.async_writer import WriterThread, save_state, stage_on_training_thread
from pretrain.checkpointing.per_rank import FORMAT, apply_payload, load_verified_state, rank_payload
from pretrain.checkpointing.state import SaveResult, TrainingState, step_manifest
from pretrain.config import Config
from pretrain.errors import ConfigError
from tiering.collective import Collective
from tiering.digest import HashSpec
from tiering.errors import PublishError, VerificationError
from tiering.manifest import Manifest
from tiering.slot_store import SlotStore
from tiering.slots import common_step, loadable, newer_than, next_sequence, slot_to_write
from tiering.verify import VERIFY_THREADS

log = logging.getLogger(__name__)

# Pickle framing and the non-tensor values of a payload, beyond its tensors' bytes (measured on
# the tiny config: ~40 KB; this leaves room for a tokenizer identity and the trainer's records).
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


class MemoryTier:
    name = "memory"

    def __init__(
        self, cfg: Config, coll: Collective, attempt: str, topology: dict[str, int], peer_bytes: int = 0
    ) -> None:
        """``peer_bytes``: a peer's state this node also holds in its tmpfs (0 until peer copies)."""
        mem = cfg.checkpoint.memory
        self.cfg = cfg
        self.coll = coll
        self.rank = coll.rank
        self.attempt = attempt
        self.topology = topology
        self.interval = mem.interval
        self.peer_bytes = peer_bytes
        self.store = SlotStore(Path(mem.dir), cfg.run.id, coll.rank, mem.slots)
        integrity = cfg.checkpoint.integrity
        self.hashing = HashSpec(integrity.local_hash, integrity.chunk_bytes, integrity.hash_threads)
        self.enabled = True
        self._inflight: _SlotWrite | None = None
        self._sequence: int | None = None
        self._mapped: set[int] = set()  # slots a loaded state may still map: rewritten on a new inode

    # -- the CheckpointTier protocol ---------------------------------------------------------------
    def due(self, step: int, final: bool) -> bool:
        return self.enabled and (final or step % self.interval == 0)

    @property
    def in_flight(self) -> int | None:
        return self._inflight.step if self._inflight is not None else None

    def busy(self) -> bool:
        return any(self.coll.all_gather(self.in_flight is not None))

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
        views = self.store.views()
        if self._sequence is None:
            self._sequence = next_sequence(views)
        job = _SlotWrite(state.step, slot_to_write(views, self.cfg.run.id), self._sequence, t0)
        self._sequence += 1
        manifest = step_manifest(self.cfg, state, FORMAT, self.attempt, owner_rank=self.rank)
        staged = stage_on_training_thread(rank_payload(state, self.rank))
        fresh = job.slot in self._mapped
        self._mapped.discard(job.slot)
        job.done = _SLOT_WRITER.submit(lambda: self._write(job, staged, manifest, fresh))
        job.blocked = time.perf_counter() - t0
        self._inflight = job
        return job.blocked

    def before_optimizer_step(self) -> float:
        """The optimizer is about to change the tensors being serialised: wait until the slot is
        sealed. Waiting for the seal, not only for the payload, is what bounds the loss to one
        step: once step s+1 is reported done, step s is loadable (the digests of a slot take a
        fraction of the forward and backward they overlap). Seconds waited."""
        job = self._inflight
        if job is None or job.done is None or job.done.is_set():
            return 0.0
        t0 = time.perf_counter()
        job.done.wait()
        waited = time.perf_counter() - t0
        job.blocked += waited
        return waited

    def poll_async(self, block: bool = False) -> SaveResult | None:
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
        return SaveResult(
            self.name, job.step, seconds, job.nbytes, self.store.slot_dir(job.slot), blocked_seconds=job.blocked
        )

    def abandon_async(self) -> None:
        """Leaving after a failure: a tmpfs write cannot hang on a device, so let it finish (and
        seal: its state is complete) rather than leave a slot half-written behind."""
        job, self._inflight = self._inflight, None
        if job is not None and job.done is not None:
            job.done.wait(timeout=60)

    def _write(self, job: _SlotWrite, staged: dict[str, Any], manifest: Manifest, fresh_inode: bool) -> None:
        """On the writer thread: payload into the slot, the chunk digests of the file, the seal."""
        try:
            job.nbytes = self.store.write_payload(job.slot, lambda fh: save_state(staged, fh), fresh_inode)
            digest = self.store.digest(job.slot, self.hashing)
            self.store.seal(job.slot, manifest, digest, job.sequence)
        except OSError as exc:
            job.error = f"{exc.filename or self.store.slot_dir(job.slot)}: {exc.strerror or exc}"
            job.full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        except Exception as exc:  # noqa: BLE001 - raised again on the training thread by poll_async
            job.crash = exc

    # -- start-up --------------------------------------------------------------------------------
    def check_capacity(self, state: TrainingState) -> None:
        """Collective: refuse to start (ConfigError, one line on every rank) when the tmpfs cannot
        hold ``slots x (own + peer)`` state for every rank of this node that shares it."""
        mem = self.cfg.checkpoint.memory
        root = Path(mem.dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(root)
            where = (socket.gethostname(), os.stat(root).st_dev)
        except OSError as exc:
            raise ConfigError(
                f"{self.cfg.source}: checkpoint.memory.dir {root}: {exc.strerror or exc}; fix: point it at a "
                "writable tmpfs (/dev/shm) or set checkpoint.memory.enabled=false"
            ) from exc
        own = tensor_bytes(rank_payload(state, self.rank)) + PAYLOAD_SLACK_BYTES
        rows = self.coll.all_gather((where, own, st.f_bavail * st.f_frsize, self.store.held_bytes()))
        mine = [r for r in rows if r[0] == where]
        need = sum(mem.slots * (o + self.peer_bytes) for _, o, _, _ in mine)
        have = min(f for _, _, f, _ in mine) + sum(h for _, _, _, h in mine)
        error = None
        if need > have:
            biggest = max(o for _, o, _, _ in mine)
            error = (
                f"{self.cfg.source}: checkpoint.memory.dir {root} has {_gib(have)} free for tier 0, but {len(mine)} "
                f"rank(s) on this node need {mem.slots} slots x (own {_gib(biggest)} + peer {_gib(self.peer_bytes)}) "
                f"= {_gib(need)}; fix: give the container at least {_gib(need)} of shared memory (docker run "
                f"--shm-size, Kubernetes emptyDir {{medium: Memory, sizeLimit}}) or set checkpoint.memory.enabled=false"
            )
        failed = next((e for e in self.coll.all_gather(error) if e), None)
        if failed:
            raise ConfigError(failed)

    # -- restore ---------------------------------------------------------------------------------
    def find_restorable(self, floor: int, suspect: set[int]) -> tuple[tuple[int, int] | None, list[tuple[int, str]]]:
        """Collective: the newest step every rank holds in a sealed slot of this run, no older than
        ``floor`` and not suspect, verified chunk by chunk on every rank: ``((step, slot), rejected)``.
        A slot that fails verification is quarantined; the ranks then agree on the next step."""
        candidates = loadable(self.store.views(), self.cfg.run.id, floor, suspect)
        rejected: list[tuple[int, str]] = []
        while True:
            step = common_step(self.coll.all_gather([v.step for v in candidates]))
            if step is None:
                return None, rejected
            slot = next(v.index for v in candidates if v.step == step)
            reason = self._check_slot(slot)
            reasons = self.coll.all_gather(reason)
            if not any(reasons):
                return (step, slot), rejected
            rejected += [(step, f"rank {r}: tier 0: {e}") for r, e in enumerate(reasons) if e]
            candidates = [v for v in candidates if v.step != step]

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
        """Unseal slots newer than the step the run resumes from (an abandoned timeline)."""
        newer = newer_than(self.store.views(), self.cfg.run.id, step)
        for index in newer:
            self.store.invalidate(index)
        return newer

    def invalidate_step(self, step: int) -> None:
        """Unseal every slot holding ``step`` (a suspect step: never restored again)."""
        for view in self.store.views():
            if view.step == step and view.run_id == self.cfg.run.id:
                self.store.invalidate(view.index)


def tensor_bytes(payload: Any) -> int:
    """Bytes of every tensor in a payload (what a slot holds, less the pickle framing)."""
    total = 0
    stack: list[Any] = [payload]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
