"""The publish protocol for a POSIX tier (node-local NVMe or a shared file system).

1. ``begin``: rank 0 creates a unique ``step-N.tmp-<attempt>`` directory; every rank writes into it.
2. ``commit`` (collective): every rank fsyncs what it wrote and hashes a share of the files (the
   chunked digests its writer computed while writing are taken as they are); rank 0 gathers sizes
   and digests into ``manifest.json``, fsyncs, renames the directory to ``step-N``
   (atomic on one file system), writes ``COMMITTED`` bound to the manifest, and replaces
   ``latest.json`` last. A published step directory is never overwritten.
3. ``abort``: if any rank failed, the temporary directory is removed and nothing is published.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering.collective import Collective
from tiering.digest import DEFAULT_HASHING, ChunkedDigest, ChunkFailure, HashSpec, hash_file
from tiering.errors import DiskFull, PublishError, ReplicaRejected, VerificationError
from tiering.layout import RunLayout, step_name
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest, check_relative_path
from tiering.system.fsio import atomic_write_bytes, fsync_dir, fsync_tree
from tiering.trust.signature import SIGNATURE_NAME, ManifestSigner
from tiering.verify import committed_marker, verify_file

log = logging.getLogger(__name__)


@dataclass
class ReceivedStep:
    """A step's files as they arrived from a peer, in ``directory`` (not published, not trusted)."""

    header: dict[str, Any]
    manifest_raw: bytes
    directory: Path
    names: list[tuple[str, int]]  # (relative path, size)
    checked: frozenset[str] = frozenset()  # files whose every chunk was checked on arrival
    mismatch: ChunkFailure | None = None  # the first chunk that did not match, if any


class PosixStepPublisher:
    """Publishes steps under ``layout``; files nobody hashed while writing are hashed at commit
    as ``hashing`` says (its thread count bounds the CPU taken from the ranks). With ``signer``
    (the reshardable tier) every step gets its ``SIGNATURE`` (:mod:`tiering.trust.signature`)."""

    def __init__(
        self,
        layout: RunLayout,
        coll: Collective,
        attempt: str,
        hashing: HashSpec = DEFAULT_HASHING,
        signer: ManifestSigner | None = None,
    ) -> None:
        self.layout = layout
        self.coll = coll
        self.attempt = attempt
        self.hashing = hashing
        self.signer = signer

    def begin(self, step: int, expected_bytes: int = 0, make_room: Callable[[], object] | None = None) -> Path:
        """Create the temporary step directory (rank 0) and return it on every rank.

        ``expected_bytes`` (e.g. the size of the previous step and the replicas the volume holds)
        is compared with the free space first: when short, ``make_room`` (dropping the tier's steps
        down to the newest verified one) runs and the space is measured again; a save that still
        cannot fit fails up front with :class:`DiskFull` instead of half-way through.
        """
        error: tuple[bool, str] | None = None  # (disk full?, one line)
        tmp = self.layout.tmp_dir(step, self.attempt)
        if self.coll.rank == 0:
            try:
                if self.layout.step_dir(step).exists():
                    raise PublishError(
                        f"{self.layout.step_dir(step)}: step already published; "
                        "published steps are immutable, refusing to overwrite"
                    )
                self.layout.steps_dir.mkdir(parents=True, exist_ok=True)
                self._check_space(step, expected_bytes, make_room)
                tmp.mkdir(exist_ok=False)
            except (OSError, PublishError) as exc:
                error = (isinstance(exc, DiskFull), str(exc))
        error = self.coll.broadcast(error)
        if error:
            raise (DiskFull if error[0] else PublishError)(error[1])
        return tmp

    def _check_space(self, step: int, needed: int, make_room: Callable[[], object] | None) -> None:
        free = shutil.disk_usage(self.layout.steps_dir).free
        if not needed or free >= needed:
            return
        if make_room is not None:
            dropped = make_room()
            free_after = shutil.disk_usage(self.layout.steps_dir).free
            log.warning(
                "%s: %.1f MB free, step %d needs ~%.1f MB: dropped older steps %s (%.1f MB free now)",
                self.layout.steps_dir,
                free / 1e6,
                step,
                needed / 1e6,
                dropped,
                free_after / 1e6,
            )
            free = free_after
        if free < needed:
            pruned = " even with only the newest verified step kept" if make_room is not None else ""
            raise DiskFull(
                f"{self.layout.steps_dir}: not enough free space (disk full): {free} bytes free, step {step} "
                f"needs ~{needed}{pruned}; older steps are intact; fix: give that volume more space or keep "
                "fewer steps (the tier's keep; for tier 1 also checkpoint.replication.factor)"
            )

    def commit(
        self,
        tmp: Path,
        manifest: Manifest,
        local_error: str | None = None,
        known: dict[str, ChunkedDigest] | None = None,
    ) -> Manifest:
        """Collective: publish ``tmp`` as its step, or abort everywhere if any rank failed.

        Every rank must call this, passing ``local_error`` (one line) if writing its part failed.
        ``known`` maps files (relative paths) to the chunked digest their writer computed while
        writing them: those are not read back (a size that differs on disk is an error).
        """
        error: str | None = None
        errors = [(rank, err) for rank, err in enumerate(self.coll.all_gather(local_error)) if err]
        if errors:
            error = f"rank {errors[0][0]} failed to write its part ({errors[0][1]})"
        else:
            entries: list[FileEntry] = []
            try:
                names = self.coll.broadcast(_list_files(tmp) if self.coll.rank == 0 else None)
                world, rank = self.coll.world_size, self.coll.rank
                entries = [self._entry(tmp, rel, known) for i, rel in enumerate(names) if i % world == rank]
            except OSError as exc:
                error = f"{exc.filename or tmp}: {exc.strerror or exc}"
            except PublishError as exc:
                error = str(exc)
            gathered = self.coll.all_gather((error, entries))
            error = next((err for err, _ in gathered if err), None)
            if error is None and self.coll.rank == 0:
                manifest.files = [entry for _, part in gathered for entry in part]
                try:
                    self._publish(tmp, manifest, frozenset(known or ()))
                except (OSError, PublishError) as exc:
                    error = f"{getattr(exc, 'filename', None) or tmp}: {getattr(exc, 'strerror', None) or exc}"
            error = self.coll.broadcast(error)
        if error is not None:
            self.abort(tmp)
            raise PublishError(f"step {manifest.step} not published: {error}; older steps are intact")
        return manifest

    def abort(self, tmp: Path) -> None:
        self.coll.barrier()
        if self.coll.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _entry(self, root: Path, rel: str, known: dict[str, ChunkedDigest] | None) -> FileEntry:
        if known and rel in known:
            digest = known[rel]
            on_disk = (root / rel).stat().st_size
            if on_disk != digest.size:
                raise PublishError(f"{root / rel}: {on_disk} bytes on disk, its writer wrote {digest.size}")
            return FileEntry.of(rel, digest)
        return FileEntry.of(rel, hash_file(root / rel, self.hashing))

    def _publish(self, tmp: Path, manifest: Manifest, written: frozenset[str]) -> None:
        raw = manifest.to_json()
        with open(tmp / MANIFEST_NAME, "xb") as fh:
            fh.write(raw)
        signature = self.signer.sign(raw) if self.signer is not None else None
        publish_dir(self.layout, tmp, manifest.step, raw, already_durable=written, signature=signature)


def publish_dir(
    layout: RunLayout,
    tmp: Path,
    step: int,
    manifest_raw: bytes,
    durable: bool = True,
    already_durable: frozenset[str] = frozenset(),
    signature: bytes | None = None,
) -> Path:
    """Make a fully written temporary directory (files + ``manifest.json``) the published step.

    Write ``COMMITTED`` bound to the manifest into it, fsync everything, and rename it atomically
    (never over a published step): the rename is the commit point, and a step is visible only with
    its marker. Then replace ``latest.json`` (a hint, not fsynced: restores scan the steps).
    ``already_durable``: files (relative paths) their writer fsynced. ``durable=False`` (a copy
    fetched to restore from, whose source still exists) leaves the data to the kernel's writeback:
    a copy torn by a crash before it fails its digests at the next restore, which then fetches again.
    ``signature``: the manifest's ``SIGNATURE`` (signed tiers), written before ``COMMITTED``.
    """
    final = layout.step_dir(step)
    if final.exists():
        raise PublishError(f"{final}: step already published; refusing to overwrite")
    if signature is not None:
        with open(tmp / SIGNATURE_NAME, "xb") as fh:
            fh.write(signature)
    (tmp / COMMITTED_NAME).write_bytes(committed_marker(step, manifest_raw))
    if durable:
        fsync_tree(tmp, skip=already_durable)
    os.rename(tmp, final)
    if durable:
        fsync_dir(final.parent)
    try:
        write_latest(layout, step)
    except OSError as exc:  # the step is committed; latest.json is only a hint
        log.warning(
            "%s: could not update latest.json (%s); step %d is committed, restore scans steps anyway",
            layout.latest_path,
            exc.strerror or exc,
            step,
        )
    return final


def write_latest(layout: RunLayout, step: int) -> None:
    body = {
        "step": step,
        "path": f"steps/{step_name(step)}",
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_bytes(layout.latest_path, (json.dumps(body) + "\n").encode(), durable=False)


def _list_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def manifest_for(run_id: str, step: int, world_size: int, parallelism: dict[str, int], **fields: Any) -> Manifest:
    return Manifest(run_id=run_id, step=step, world_size=world_size, parallelism=parallelism, files=[], **fields)


def publish_received(
    layout: RunLayout,
    received: ReceivedStep,
    expect_run_id: str,
    expect_step: int,
    expect_owner: int | None = None,
    durable: bool = True,
) -> Manifest:
    """Publish a step received from another rank, byte for byte under the owner's manifest.

    ``received.directory`` (in ``layout.steps_dir``) holds the files as they arrived. The header
    and the manifest must name the run, step and owner expected, every file must be listed with
    its size, and every chunk must match: files checked on arrival by the transport are not
    hashed again, others (format v1) are checked on disk now. A mismatch raises
    :class:`ReplicaRejected` naming the file (and chunk) and removes the directory: nothing is
    published. ``durable``: see :func:`publish_dir`.
    """
    final = layout.step_dir(expect_step)
    try:
        manifest = check_received(received, final, expect_run_id, expect_step, expect_owner)
        if final.exists():
            if (final / COMMITTED_NAME).is_file() and (final / MANIFEST_NAME).read_bytes() == received.manifest_raw:
                shutil.rmtree(received.directory, ignore_errors=True)
                return manifest  # already here, identical: idempotent
            raise PublishError(f"{final}: a different step is already published here; refusing to overwrite")
        if received.directory.parent != layout.steps_dir:
            raise PublishError(f"{received.directory}: not in {layout.steps_dir}, cannot be renamed into place")
        with open(received.directory / MANIFEST_NAME, "xb") as fh:
            fh.write(received.manifest_raw)
        publish_dir(layout, received.directory, expect_step, received.manifest_raw, durable)
    except BaseException:
        shutil.rmtree(received.directory, ignore_errors=True)
        raise
    return manifest


def check_received(received: ReceivedStep, final: Path, run_id: str, step: int, owner: int | None) -> Manifest:
    """Header, manifest, file list, sizes and every chunk of a received step; the manifest.
    Raises :class:`ReplicaRejected` naming ``final``'s file; leaves ``received.directory`` as it is."""
    where = final / MANIFEST_NAME
    head = received.header
    claimed = (head.get("run_id"), head.get("step"), head.get("owner") if owner is not None else None)
    if claimed != (run_id, step, owner):
        raise ReplicaRejected(
            where,
            f"sender claims run {claimed[0]!r} step {claimed[1]} owner {head.get('owner')}, "
            f"expected {run_id!r} step {step} owner {owner}",
            "the replica is discarded",
        )
    manifest = Manifest.from_json(received.manifest_raw, where)
    claims = [
        (manifest.run_id == run_id, f"replica belongs to run {manifest.run_id!r}, expected {run_id!r}"),
        (manifest.step == step, f"replica manifest is for step {manifest.step}, expected {step}"),
        (
            owner is None or manifest.extra.get("owner_rank") == owner,
            f"replica manifest is owned by rank {manifest.extra.get('owner_rank')}, expected {owner}",
        ),
    ]
    for ok, reason in claims:
        if not ok:
            raise ReplicaRejected(where, reason, "the replica is discarded")
    listed = {f.path: f for f in manifest.files}
    sizes = dict(received.names)
    if set(listed) != set(sizes):
        missing = sorted(set(listed) ^ set(sizes))
        raise ReplicaRejected(final / missing[0], "received files differ from the manifest", "the replica is discarded")
    for rel, size in sizes.items():
        check_relative_path(rel, where)
        if size != listed[rel].bytes or (received.directory / rel).stat().st_size != size:
            raise ReplicaRejected(final / rel, "received size differs from the manifest", "the replica is discarded")
    if received.mismatch is not None:
        rel, reason = received.mismatch
        raise ReplicaRejected(final / rel, f"received {reason}", "the replica is discarded")
    for rel, entry in listed.items():
        if rel not in received.checked:
            try:
                verify_file(received.directory / rel, entry)
            except VerificationError as exc:
                raise ReplicaRejected(final / rel, f"received {exc.reason}", "the replica is discarded") from exc
    return manifest
