"""The agent's work on one node: a sealed tier-0 slot becomes a published tier-1 step.

:class:`SlotDrain` owns, for one run on one node, the copy of a rank's sealed slot (tmpfs) into
that rank's tier-1 store (``checkpoint.local.dir``, the publish protocol of :mod:`tiering.local.publish`),
checked against the slot's own chunk digests while it is copied, and the tier-1 retention that
follows. It is what the agent process runs on its worker thread; it has no socket and no process
group, so it is tested in one process on real files.

Never: publishes a copy whose bytes differ from the slot's seal (a slot rewritten while it was
copied is *torn*: reported, nothing published), deletes the newest step every rank of the run has
persisted (the ``floor`` the ranks agree on and hand over), or touches a slot (it only reads).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tiering.collective import SingleProcess
from tiering.digest import ChunkedDigest, HashSpec
from tiering.errors import DiskFull, TieringError, VerificationError
from tiering.layout import parse_tmp_name
from tiering.local.posix import PosixTier, primary_store
from tiering.local.publish import PosixStepPublisher
from tiering.manifest import Manifest
from tiering.memory.slot_store import STATE_FILE, SlotStore
from tiering.retention import KeepNewest
from tiering.system.fsio import write_file_durably
from tiering.verify import read_manifest

log = logging.getLogger(__name__)

ATTEMPT_PREFIX = "agent-"  # temporary step directories of an agent: ``step-N.tmp-agent-<pid>``
TORN = "torn"  # a slot whose bytes changed while the agent copied it
DISK_FULL = "disk_full"
COPY_PIECE = 8 * 1024 * 1024
# Slot header fields of tier 0 that a tier-1 manifest does not carry.
_SLOT_FIELDS = ("tier", "sequence", "slot", "rank")


@dataclass(frozen=True)
class Persist:
    """A rank's request: publish the step sealed in its slot ``slot`` to tier 1."""

    rank: int
    slot: int
    step: int


@dataclass
class RankProgress:
    """What the agent did for one rank: the newest steps it published, the one it failed last."""

    persisted: list[int] = field(default_factory=list)  # committed tier-1 steps, newest first
    failed: dict[int, str] = field(default_factory=dict)  # step -> one line


class SlotDrain:
    """Publishes sealed slots of run ``run_id`` under ``memory_root`` to tier 1 under ``local_root``."""

    def __init__(
        self,
        memory_root: Path,
        local_root: Path,
        run_id: str,
        slots: int,
        keep: int,
        hash_threads: int = 2,
    ) -> None:
        self.memory_root = Path(memory_root)
        self.node_root = Path(local_root) / run_id
        self.run_id = run_id
        self.slots = slots
        self.keep = keep
        self.hash_threads = hash_threads
        self.attempt = f"{ATTEMPT_PREFIX}{os.getpid()}"
        self.progress: dict[int, RankProgress] = {}  # read under the agent's lock; filled by its worker
        self.floors: dict[int, int] = {}  # rank -> the newest step every rank persisted (the ranks say)

    def store(self, rank: int) -> PosixTier:
        return primary_store(self.node_root, rank, self.run_id, self.keep)

    def slot_store(self, rank: int) -> SlotStore:
        return SlotStore(self.memory_root, self.run_id, rank, self.slots)

    def rank_progress(self, rank: int) -> RankProgress:
        """The rank's progress; its first call lists the rank's tier-1 store (the worker's thread)."""
        if rank not in self.progress:
            self.progress[rank] = RankProgress(persisted=self.store(rank).committed_steps())
        return self.progress[rank]

    def clean_stale(self, rank: int) -> list[Path]:
        """Temporary step directories of agents that died mid-copy (never published: removed)."""
        steps = self.store(rank).layout.steps_dir
        removed = []
        for path in steps.iterdir() if steps.is_dir() else []:
            parsed = parse_tmp_name(path.name)
            if parsed and parsed[1].startswith(ATTEMPT_PREFIX) and parsed[1] != self.attempt:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    # -- one request ---------------------------------------------------------------------------
    def persist(self, job: Persist) -> str | None:
        """Publish ``job``'s slot as tier-1 step ``job.step`` of ``job.rank``; None, or why not (one
        line, also kept in the rank's progress). A step already published counts as done."""
        progress = self.rank_progress(job.rank)
        store = self.store(job.rank)
        error: str | None = None
        try:
            if job.step in store.committed_steps():
                self._same_as_published(job, store)  # asked again, or an abandoned timeline's step
            else:
                self._publish(job, store)
        except VerificationError as exc:
            error = f"{TORN}: {exc}"
        except DiskFull as exc:
            error = f"{DISK_FULL}: {exc}"
        except OSError as exc:
            kind = f"{DISK_FULL}: " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            error = f"{kind}{exc.filename or store.layout.steps_dir}: {exc.strerror or exc}"
        except TieringError as exc:
            error = str(exc)
        progress.persisted = store.committed_steps()
        if error is None:
            progress.failed.pop(job.step, None)
            self.retain(job.rank)
            return None
        progress.failed[job.step] = error
        log.warning("agent: rank %d step %d not persisted in tier 1: %s", job.rank, job.step, error)
        return error

    def _same_as_published(self, job: Persist, store: PosixTier) -> None:
        """A published step counts as this request's only with the seal's bytes: the same step of
        an abandoned timeline (a resume from an older step) is a different state."""
        sealed = read_manifest(self.slot_store(job.rank).slot_dir(job.slot))
        published = read_manifest(store.step_path(job.step))
        mine = {f.path: f.digest for f in sealed.files}
        theirs = {f.path: f.digest for f in published.files}
        if sealed.step != job.step or mine.get(STATE_FILE) != theirs.get(STATE_FILE):
            raise TieringError(
                f"{store.step_path(job.step)}: step {job.step} is published with other bytes (a timeline the run "
                "abandoned); fix: none needed, the next step is saved, this one stays as it is"
            )

    def _publish(self, job: Persist, store: PosixTier) -> None:
        """Copy the slot into a temporary step directory, hashing what is written; publish only
        when the copy's digests equal the seal's (the seal is read before the copy starts)."""
        slots = self.slot_store(job.rank)
        sealed = read_manifest(slots.slot_dir(job.slot))
        if sealed.step != job.step or sealed.run_id != self.run_id:
            raise VerificationError(slots.slot_dir(job.slot), f"holds step {sealed.step}, not {job.step}")
        entry = next((f for f in sealed.files if f.path == STATE_FILE), None)
        expected = entry.chunked if entry is not None else None
        if expected is None:
            raise VerificationError(slots.slot_dir(job.slot), "the seal names no chunked state file")
        publisher = PosixStepPublisher(store.layout, SingleProcess(), self.attempt)
        tmp = publisher.begin(job.step, expected.size, lambda: self._make_room(job.rank))
        try:
            spec = HashSpec(expected.hash, expected.chunk_bytes, self.hash_threads)
            copied = write_file_durably(tmp / STATE_FILE, lambda out: _copy(slots.state_path(job.slot), out), spec)
            _same_bytes(copied, expected, slots.state_path(job.slot))
            publisher.commit(tmp, tier1_manifest(sealed), known={STATE_FILE: copied})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # -- retention -----------------------------------------------------------------------------
    def set_floor(self, rank: int, floor: int | None) -> None:
        """What a rank said (no I/O: the agent's socket loop calls it)."""
        if floor is not None:
            self.floors[rank] = floor

    def _protected(self, rank: int) -> set[int]:
        """Steps retention must keep for ``rank``: the floor and newer (until a rank says the floor,
        every step: nothing is known of the other ranks yet)."""
        floor = self.floors.get(rank)
        committed = self.store(rank).committed_steps()
        if floor is None:
            return set(committed)
        return {s for s in committed if s >= floor}

    def retain(self, rank: int) -> list[int]:
        dropped = self.store(rank).apply_retention(protected=self._protected(rank))
        self.rank_progress(rank).persisted = self.store(rank).committed_steps()
        return dropped

    def _make_room(self, rank: int) -> list[int]:
        """A full volume: every rank's store of this node keeps its newest verified step and the
        floor (the newest step every rank has), never less."""
        dropped = []
        for owner in sorted(self.progress):
            dropped += self.store(owner).apply_retention(protected=self._protected(owner), policy=KeepNewest(1))
        return dropped


def tier1_manifest(sealed: Manifest) -> Manifest:
    """The slot's manifest as a tier-1 step's: the same run, step, topology and provenance,
    without tier 0's slot fields (its files are listed again at commit)."""
    extra = {k: v for k, v in sealed.extra.items() if k not in _SLOT_FIELDS}
    extra["persisted_by"] = "agent"
    extra["persisted_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return Manifest(
        sealed.run_id,
        sealed.step,
        sealed.world_size,
        dict(sealed.parallelism),
        [],
        dict(sealed.framework),
        dict(sealed.code_version),
        sealed.dataset_snapshot,
        sealed.format,
        extra,
    )


def _copy(src: Path, out: IO[bytes]) -> None:
    with open(src, "rb", buffering=0) as fh:
        while piece := fh.read(COPY_PIECE):
            out.write(piece)


def _same_bytes(copied: ChunkedDigest, expected: ChunkedDigest, where: Path) -> None:
    if copied.size != expected.size:
        raise VerificationError(where, f"{copied.size} bytes copied, the seal says {expected.size}")
    bad = next((i for i, (a, b) in enumerate(zip(copied.chunks, expected.chunks, strict=True)) if a != b), None)
    if bad is not None:
        raise VerificationError(where, f"chunk {bad} changed while it was copied (the slot was rewritten)")
