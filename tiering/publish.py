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
from pathlib import Path
from typing import Any

from tiering.collective import Collective
from tiering.digest import DEFAULT_HASHING, ChunkedDigest, HashSpec, StreamChecker, hash_bytes, hash_file
from tiering.errors import PublishError, ReplicaRejected
from tiering.fsio import atomic_write_bytes, fsync_dir, fsync_tree
from tiering.layout import RunLayout, step_name
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest, check_relative_path
from tiering.verify import committed_marker

log = logging.getLogger(__name__)


class PosixStepPublisher:
    """Publishes steps under ``layout``; files nobody hashed while writing are hashed at commit
    as ``hashing`` says (its thread count bounds the CPU taken from the ranks)."""

    def __init__(self, layout: RunLayout, coll: Collective, attempt: str, hashing: HashSpec = DEFAULT_HASHING) -> None:
        self.layout = layout
        self.coll = coll
        self.attempt = attempt
        self.hashing = hashing

    def begin(self, step: int, expected_bytes: int = 0) -> Path:
        """Create the temporary step directory (rank 0) and return it on every rank.

        ``expected_bytes`` (e.g. the size of the previous step) lets a save that cannot fit fail up
        front with a clear message instead of half-way through with whatever the writer reports.
        """
        error = None
        tmp = self.layout.tmp_dir(step, self.attempt)
        if self.coll.rank == 0:
            try:
                if self.layout.step_dir(step).exists():
                    raise PublishError(
                        f"{self.layout.step_dir(step)}: step already published; "
                        "published steps are immutable, refusing to overwrite"
                    )
                self.layout.steps_dir.mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(self.layout.steps_dir).free
                if expected_bytes and free < expected_bytes:
                    raise PublishError(
                        f"{self.layout.steps_dir}: not enough free space for step {step} "
                        f"(needs ~{expected_bytes / 1e6:.1f} MB, {free / 1e6:.1f} MB free), older steps are "
                        "intact; fix: free space on that volume or lower checkpoint.local.keep"
                    )
                tmp.mkdir(exist_ok=False)
            except (OSError, PublishError) as exc:
                error = str(exc)
        error = self.coll.broadcast(error)
        if error:
            raise PublishError(error)
        return tmp

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
        publish_dir(self.layout, tmp, manifest.step, raw, already_durable=written)


def publish_dir(
    layout: RunLayout,
    tmp: Path,
    step: int,
    manifest_raw: bytes,
    durable: bool = True,
    already_durable: frozenset[str] = frozenset(),
) -> Path:
    """Make a fully written temporary directory (files + ``manifest.json``) the published step.

    Write ``COMMITTED`` bound to the manifest into it, fsync everything, and rename it atomically
    (never over a published step): the rename is the commit point, and a step is visible only with
    its marker. Then replace ``latest.json`` (a hint, not fsynced: restores scan the steps).
    ``already_durable``: files (relative paths) their writer fsynced. ``durable=False`` (a copy
    fetched to restore from, whose source still exists) leaves the data to the kernel's writeback:
    a copy torn by a crash before it fails its digests at the next restore, which then fetches again.
    """
    final = layout.step_dir(step)
    if final.exists():
        raise PublishError(f"{final}: step already published; refusing to overwrite")
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


def _check_received(manifest: Manifest, files: list[tuple[str, bytes | memoryview]]) -> tuple[str, str] | None:
    """Files already in memory: v2 chunks on two threads, v1 whole (SHA-256); the first failure."""
    listed = {f.path: f for f in manifest.files}
    for rel, data in files:
        expected = listed[rel].chunked
        if expected is None:
            same = hash_bytes("sha256", data) == listed[rel].sha256
            bad = None if same else (rel, "bytes do not match the manifest's SHA-256")
        else:
            bad = StreamChecker(memoryview(data).cast("B"), [(rel, expected)]).result()
        if bad is not None:
            return bad
    return None


def manifest_for(run_id: str, step: int, world_size: int, parallelism: dict[str, int], **fields: Any) -> Manifest:
    return Manifest(run_id=run_id, step=step, world_size=world_size, parallelism=parallelism, files=[], **fields)


def publish_received(
    layout: RunLayout,
    manifest_raw: bytes,
    files: list[tuple[str, bytes | memoryview]],
    attempt: str,
    expect_run_id: str,
    expect_step: int,
    expect_owner: int | None = None,
    checked: StreamChecker | None = None,
    durable: bool = True,
    spilled: Path | None = None,
) -> Manifest:
    """Publish a step received from another rank, byte for byte under the owner's manifest.

    Sizes and digests of every received file are checked against the manifest (and the manifest
    against the run, step and owner the sender claims) before anything is published; a mismatch
    raises :class:`ReplicaRejected` naming the file and chunk, and nothing is written. ``checked``:
    the chunks were already checked as they arrived (by the transport, against this manifest), so
    nothing is hashed a second time here. ``durable``: see :func:`publish_dir`. ``spilled``: the
    transport already wrote the files there as they arrived (this rank's temporary directory).
    """
    final = layout.step_dir(expect_step)
    where = final / MANIFEST_NAME
    manifest = Manifest.from_json(manifest_raw, where)
    if manifest.run_id != expect_run_id:
        raise ReplicaRejected(
            where, f"replica belongs to run {manifest.run_id!r}, expected {expect_run_id!r}", "the replica is discarded"
        )
    if manifest.step != expect_step:
        raise ReplicaRejected(
            where, f"replica manifest is for step {manifest.step}, expected {expect_step}", "the replica is discarded"
        )
    if expect_owner is not None and manifest.extra.get("owner_rank") != expect_owner:
        raise ReplicaRejected(
            where,
            f"replica manifest is owned by rank {manifest.extra.get('owner_rank')}, expected {expect_owner}",
            "the replica is discarded",
        )
    listed = {f.path: f for f in manifest.files}
    received = dict(files)
    if set(listed) != set(received):
        missing = sorted(set(listed) ^ set(received))
        raise ReplicaRejected(final / missing[0], "received files differ from the manifest", "the replica is discarded")
    for rel, data in received.items():
        check_relative_path(rel, where)
        if len(data) != listed[rel].bytes:
            raise ReplicaRejected(final / rel, "received size differs from the manifest", "the replica is discarded")
    bad = checked.result() if checked is not None else _check_received(manifest, files)
    if bad is not None:
        raise ReplicaRejected(final / bad[0], f"received {bad[1]}", "the replica is discarded")
    if final.exists():
        if (final / COMMITTED_NAME).is_file() and (final / MANIFEST_NAME).read_bytes() == manifest_raw:
            return manifest  # already here, identical: idempotent
        raise PublishError(f"{final}: a different step is already published here; refusing to overwrite")
    tmp = layout.tmp_dir(expect_step, attempt)
    if tmp.exists() and tmp != spilled:
        shutil.rmtree(tmp)
    try:
        for rel, data in received.items() if tmp != spilled else ():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as fh:
                fh.write(data)
        with open(tmp / MANIFEST_NAME, "xb") as fh:
            fh.write(manifest_raw)
        publish_dir(layout, tmp, expect_step, manifest_raw, durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
