"""Tier-0 slot files: ``<root>/<run_id>/rank-NNNNN/slot-K/{state.pt, manifest.json, COMMITTED}``,
and the peer copies a rank holds for another rank: ``<root>/<run_id>/peers/rank-NNNNN/slot-K``
(the owner's rank; the same layout, filled by :mod:`tiering.memory.peer_slots`).

A slot is a step directory in the manifest-v2 layout, so :func:`tiering.verify.verify_step` (and
``tiering verify``/``tiering ls``) read it like any other tier. The header is the pair
``manifest.json`` (run id, step, sequence number, sizes, chunk digests of the payload) and
``COMMITTED`` (binds the marker to that manifest). The store

* invalidates a slot (``COMMITTED`` first, then the manifest) before its payload is touched,
* rewrites the payload in place (the tmpfs pages of the last write are reused, not allocated
  again), or on a fresh inode when the old one may still be mapped by a loaded state,
* seals it (manifest, then ``COMMITTED``, each by an atomic rename) once the chunk digests of the
  complete payload are known,

so a kill at any instant leaves the slot either sealed with the bytes its digests describe or
unsealed (never loaded). Which slot to write or load is :mod:`tiering.memory.slots`' decision; the
memory tier (``pretrain/checkpointing/memory_tier.py``) drives it. The store never decides policy
and never hashes while the payload's source may still change (the caller hashes the file).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tiering.digest import ChunkedDigest, ChunkHashingSink, HashSpec, hash_file
from tiering.errors import VerificationError
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest
from tiering.memory.slots import SlotView
from tiering.system.fsio import atomic_write_bytes
from tiering.verify import committed_marker, read_manifest, verify_step

STATE_FILE = "state.pt"
PEERS_DIR = "peers"  # under a run's tier-0 directory: the copies held for other ranks
_SLOT_RE = re.compile(r"^slot-(\d+)$")
_RANK_RE = re.compile(r"^rank-(\d{5})$")


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def parse_rank_dir(name: str) -> int | None:
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m else None


def is_slot_dir(path: Path) -> bool:
    return _SLOT_RE.match(path.name) is not None and path.is_dir()


class SlotStore:
    """One rank's slots of one run under a tier-0 root (a tmpfs directory); ``peer``: the copies of
    ``rank``'s slots another rank holds (under ``peers/``)."""

    def __init__(self, root: Path, run_id: str, rank: int, slots: int, peer: bool = False) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self.rank = rank
        self.slots = slots
        self.peer = peer
        run = self.root / run_id
        self.rank_dir = (run / PEERS_DIR if peer else run) / rank_dir_name(rank)

    def slot_dir(self, index: int) -> Path:
        return self.rank_dir / f"slot-{index}"

    def state_path(self, index: int) -> Path:
        return self.slot_dir(index) / STATE_FILE

    @property
    def quarantine_dir(self) -> Path:
        return self.rank_dir / "quarantine"

    # -- reading the headers -----------------------------------------------------------------------
    def views(self) -> list[SlotView]:
        """What every slot holds, from its header alone (no payload byte is read)."""
        return [self.view(i) for i in range(self.slots)]

    def view(self, index: int) -> SlotView:
        slot = self.slot_dir(index)
        if not slot.is_dir():
            return SlotView.empty(index)
        try:
            manifest = read_manifest(slot)
        except (VerificationError, OSError):
            return SlotView.unsealed(index)
        sequence = manifest.extra.get("sequence")
        if not isinstance(sequence, int) or manifest.extra.get("tier") != 0:
            return SlotView.unsealed(index)
        return SlotView.sealed(index, manifest.run_id, manifest.step, sequence)

    def held_bytes(self) -> int:
        """Bytes of payload this rank's slots hold now (they are overwritten, not added to)."""
        return sum(p.stat().st_size for p in (self.state_path(i) for i in range(self.slots)) if p.is_file())

    # -- writing ---------------------------------------------------------------------------------
    def invalidate(self, index: int) -> None:
        """Unseal: after this returns, a reader never loads the slot (marker first, then header)."""
        slot = self.slot_dir(index)
        (slot / COMMITTED_NAME).unlink(missing_ok=True)
        (slot / MANIFEST_NAME).unlink(missing_ok=True)
        for stray in slot.glob(".*.tmp-*") if slot.is_dir() else []:  # a header write a kill cut short
            stray.unlink(missing_ok=True)

    def write_payload(self, index: int, write: Callable[[IO[bytes]], object], fresh_inode: bool) -> int:
        """Invalidate the slot, then write its payload with ``write(file)`` from offset 0; returns
        its size. In place by default (tmpfs pages reused); ``fresh_inode``: unlink first (a state
        loaded from this file may still map its pages). An OSError (a full tmpfs) leaves the slot
        unsealed and its payload removed, so no memory is held by a slot that cannot be used."""
        return self._write(index, write, fresh_inode, None)[0]

    def write_hashed(
        self, index: int, write: Callable[[IO[bytes]], object], fresh_inode: bool, hashing: HashSpec
    ) -> ChunkedDigest:
        """:meth:`write_payload`, the chunk digests computed from the bytes as they are written
        (``hashing.threads`` lanes beside the writer): the seal needs no second pass over the slot."""
        digest = self._write(index, write, fresh_inode, hashing)[1]
        assert digest is not None
        return digest

    def _write(
        self, index: int, write: Callable[[IO[bytes]], object], fresh_inode: bool, hashing: HashSpec | None
    ) -> tuple[int, ChunkedDigest | None]:
        self.invalidate(index)
        path = self.state_path(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh_inode:
            path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        sink = _PayloadFile(fd)
        hashed = ChunkHashingSink(sink, hashing.name, hashing.chunk_bytes, hashing.threads) if hashing else None
        digest = None
        try:
            try:
                write(hashed if hashed is not None else sink)
            except Exception as exc:
                if sink.failure is not None:  # torch.save reports a failed write as its own RuntimeError
                    raise sink.failure from exc
                raise
            finally:
                digest = hashed.finish() if hashed is not None else None  # its lanes never outlive the write
            os.ftruncate(fd, sink.size)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return sink.size, digest

    def digest(self, index: int, hashing: HashSpec) -> ChunkedDigest:
        """The chunk digests of the slot's payload as it is now (the payload no longer changes)."""
        return hash_file(self.state_path(index), hashing)

    def seal(self, index: int, manifest: Manifest, digest: ChunkedDigest, sequence: int) -> None:
        """Write the header of a complete payload: the manifest, then ``COMMITTED`` (each atomic)."""
        manifest.files = [FileEntry.of(STATE_FILE, digest)]
        self.seal_checked(index, manifest, sequence)

    def seal_checked(self, index: int, manifest: Manifest, sequence: int) -> None:
        """Seal a payload whose every chunk is known to match ``manifest.files`` (a copy received
        from another rank and checked on arrival): the manifest, then ``COMMITTED``."""
        manifest.extra = {**manifest.extra, "tier": 0, "sequence": sequence, "slot": index, "rank": self.rank}
        raw = manifest.to_json()
        slot = self.slot_dir(index)
        atomic_write_bytes(slot / MANIFEST_NAME, raw, durable=False)  # tmpfs: nothing to flush
        atomic_write_bytes(slot / COMMITTED_NAME, committed_marker(manifest.step, raw), durable=False)

    # -- restoring -------------------------------------------------------------------------------
    def verify(self, index: int, threads: int) -> Manifest:
        """Every chunk of the slot against its header; raises VerificationError naming the chunk."""
        return verify_step(self.slot_dir(index), expect_run_id=self.run_id, threads=threads)

    def quarantine(self, index: int, reason: str) -> Path | None:
        """Move a slot that failed verification aside with its reason. Only the newest quarantined
        slot is kept: tmpfs is memory, and one bad copy is enough to examine."""
        slot = self.slot_dir(index)
        if not slot.is_dir():
            return None
        shutil.rmtree(self.quarantine_dir, ignore_errors=True)
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        target = self.quarantine_dir / slot.name
        os.replace(slot, target)
        (target / "REASON").write_text(reason + "\n", encoding="utf-8")
        return target


class _PayloadFile(io.RawIOBase):
    """The file a payload is serialised into, from offset 0 of an existing inode (no truncation
    first: the tmpfs pages are reused). It keeps the first OSError of a write, which a serialiser
    may replace with an error of its own while unwinding (``torch.save`` does)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.size = 0
        self.failure: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < view.nbytes:
                done += os.pwrite(self._fd, view[done:], self.size + done)
        except OSError as exc:
            self.failure = self.failure or exc
            raise
        self.size += done
        return done
