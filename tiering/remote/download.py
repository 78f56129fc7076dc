"""Verified download of a step from an object store, and restore of the newest one that verifies.

A step is read only once its ``COMMITTED`` object matches its manifest and, for a signed run, its
``SIGNATURE`` object verifies (:mod:`tiering.trust.signature`), before the manifest is parsed; a manifest
naming a digest other than the run's (``RemoteRun.expect_hash``) is refused before any GET of its
data. Format v2: every digest
chunk is one ranged GET, hashed and written at its offset piece by piece as it arrives (several in
parallel, a body that breaks off asked for again); nothing is read back. Format v1: whole objects,
then one SHA-256 pass. Bytes land in a temporary directory and are published locally (the same
atomic rename as a local save) only after every byte verified; a step that fails is reported as a
:class:`VerificationError` naming the object and chunk, and an older step is tried. A missing
object is :class:`ObjectNotFound` from the store, caught around that one request only. Called by
:class:`tiering.remote.tier.RemoteTier` (the trainer's restore, ``tiering restore``, ``pretrain
evaluate``); it never writes to the store.

Given a :class:`tiering.collective.Collective` (the trainer's restore into the shared reshardable
tier), every rank fetches and checks a share of the step's files (whole files, balanced by bytes:
no two ranks write one file) into the one temporary directory, then all agree: one rank's failure
is every rank's (the same error class and line), so ranks stay in step through older steps; rank 0
publishes. No rank waits alone behind another's whole download.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from tiering.collective import Collective, SingleProcess
from tiering.digest import bad_chunk_reason, chunk_range, new_hasher
from tiering.errors import ObjectNotFound, ObjectStoreError, TransferInterrupted, VerificationError
from tiering.layout import RunLayout
from tiering.local.posix import PosixTier
from tiering.local.publish import publish_dir
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest
from tiering.remote.run import RemoteRun
from tiering.remote.upload import latest_hint
from tiering.trust.signature import SIGNATURE_NAME
from tiering.verify import committed_marker, verify_file, verify_step

log = logging.getLogger(__name__)
FETCH_ATTEMPTS = 3  # requests per chunk when its body breaks off mid-way (reset, read timeout)
T = TypeVar("T")


def read_remote_manifest(run: RemoteRun, step: int) -> tuple[Manifest, bytes]:
    """The committed manifest of ``step`` and its raw bytes; :class:`VerificationError` if the step is not committed,
    its ``COMMITTED`` does not match, or (a signed run) its ``SIGNATURE`` is missing or forged."""
    manifest, raw, _ = read_signed_manifest(run, step)
    return manifest, raw


def read_signed_manifest(run: RemoteRun, step: int) -> tuple[Manifest, bytes, bytes | None]:
    """:func:`read_remote_manifest`, with the ``SIGNATURE`` object's bytes (None: absent, in a run
    without a signer)."""
    where = run.where(run.step_key(step, MANIFEST_NAME))
    # Independent small GETs, sent together: a restore waits one first-byte latency of the
    # store for them, not two or three.
    names = (COMMITTED_NAME, MANIFEST_NAME, SIGNATURE_NAME)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        gets = {name: pool.submit(_get_or_none, run, run.step_key(step, name)) for name in names}
    marker, raw, signature = (gets[name].result() for name in names)
    if marker is None:
        raise VerificationError(
            run.where(run.step_key(step, COMMITTED_NAME)),
            "COMMITTED object is missing: the upload never finished",
        )
    if raw is None:
        raise VerificationError(where, "manifest.json object is missing")
    if run.signer is not None:  # before the manifest is parsed or anything it names is fetched
        run.signer.check(raw, signature, run.where(run.step_key(step, SIGNATURE_NAME)))
    manifest = Manifest.from_json(raw, where)
    if marker != committed_marker(step, raw):
        raise VerificationError(
            run.where(run.step_key(step, COMMITTED_NAME)),
            "COMMITTED does not match manifest.json (manifest changed after commit)",
        )
    if manifest.step != step or manifest.run_id != run.run_id:
        raise VerificationError(where, f"manifest names run {manifest.run_id!r} step {manifest.step}")
    if run.expect_hash is not None:
        for entry in manifest.files:
            if entry.hash != run.expect_hash:
                hashed = entry.hash or "sha256 (v1)"
                reason = f"{entry.path} is hashed with {hashed}, this tier reads {run.expect_hash} only"
                raise VerificationError(where, reason)
    return manifest, raw, signature


def _get_or_none(run: RemoteRun, key: str) -> bytes | None:
    try:
        return run.store.get_bytes(key)[0]
    except ObjectNotFound:
        return None


def download_step(run: RemoteRun, step: int, layout: RunLayout, attempt: str, coll: Collective | None = None) -> Path:
    """Download, verify every byte, and publish the step locally under ``layout``.

    Format v2: every digest chunk is one ranged GET, hashed and written at its offset piece by
    piece as it arrives (several in parallel); nothing is read back. Format v1: whole objects,
    then one SHA-256 pass. With ``coll`` (collective; ``layout`` on storage every rank sees) each
    rank fetches and checks :func:`share_of` the files; rank 0 publishes once all agree.
    """
    coll = coll or SingleProcess()
    got = agreed(coll, lambda: read_signed_manifest(run, step) if coll.rank == 0 else None)
    raw, signature = coll.broadcast((got[1], got[2]) if got is not None else None)
    manifest = got[0] if got is not None else Manifest.from_json(raw, run.where(run.step_key(step, MANIFEST_NAME)))
    final = layout.step_dir(step)
    if coll.broadcast(agreed(coll, lambda: _already_here(run, layout, step) if coll.rank == 0 else None)):
        return final
    tmp = layout.tmp_dir(step, coll.broadcast(attempt))  # one directory for every rank's files
    agreed(coll, lambda: _fresh_tmp(tmp, step, raw) if coll.rank == 0 else None)
    try:
        mine = share_of(manifest.files, coll.rank, coll.world_size)
        agreed(coll, lambda: _fetch_mine(run, step, tmp, manifest, mine, coll.rank))
        # Every rank's files are in place: rank 0 checks the whole step's structure (sizes, nothing unlisted).
        agreed(coll, lambda: _check_structure(run, step, tmp) if coll.rank == 0 else None)
        # The same publish as a local save (atomic rename, COMMITTED, latest.json), minus the
        # fsync of the data: the object store keeps its copy; a copy torn by a crash fails its
        # digests at the next restore and is fetched again.
        publish = lambda: publish_dir(layout, tmp, step, raw, durable=False, signature=signature)  # noqa: E731
        agreed(coll, lambda: publish() if coll.rank == 0 else None)
    except BaseException:
        if coll.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _already_here(run: RemoteRun, layout: RunLayout, step: int) -> bool:
    """Whether the step is published here already and verifies (a copy that does not is
    quarantined, kept as evidence: the error may be a transient read error of shared storage)."""
    final = layout.step_dir(step)
    if not final.exists():
        return False
    try:
        verify_step(final, expect_run_id=run.run_id, expect_hash=run.expect_hash, signer=run.signer)
        return True
    except VerificationError as exc:
        PosixTier(layout.root, layout.run_id).quarantine(step, str(exc))
        return False


def _check_structure(run: RemoteRun, step: int, tmp: Path) -> None:
    """The whole fetched step: marker, manifest, sizes, nothing unlisted (the bytes were checked as fetched)."""

    def check() -> None:
        verify_step(tmp, expect_run_id=run.run_id, hash_files=False, expect_hash=run.expect_hash)

    _named_in_store(run, step, tmp, check)


def _fresh_tmp(tmp: Path, step: int, raw: bytes) -> None:
    """An empty temporary directory with the step's manifest and marker, for every rank's files."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / MANIFEST_NAME).write_bytes(raw)
    (tmp / COMMITTED_NAME).write_bytes(committed_marker(step, raw))


def share_of(files: list[FileEntry], rank: int, world: int) -> list[FileEntry]:
    """The files ``rank`` of ``world`` fetches: largest first, each to the rank with the fewest bytes
    so far (ties to the lower rank); the same answer on every rank, every file on exactly one."""
    load = [0] * world
    owner: dict[str, int] = {}
    for entry in sorted(files, key=lambda f: (-f.bytes, f.path)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[entry.path] = r
        load[r] += entry.bytes
    return [entry for entry in files if owner[entry.path] == rank]


def _fetch_mine(run: RemoteRun, step: int, tmp: Path, manifest: Manifest, mine: list[FileEntry], rank: int) -> None:
    """This rank's files into ``tmp``, each chunk checked as it arrives (v2) or each file hashed
    after (v1)."""
    chunked = all(f.chunked is not None for f in manifest.files)
    if mine:
        (_fetch_chunks if chunked else _fetch_whole)(run, step, tmp, mine)
    log.info(
        "S3 step %d: rank %d fetched %d of %d files (%d bytes)",
        step, rank, len(mine), len(manifest.files), sum(f.bytes for f in mine),
    )  # fmt: skip
    if not chunked:
        for entry in mine:
            _named_in_store(run, step, tmp, lambda entry=entry: verify_file(tmp / entry.path, entry))


def _named_in_store(run: RemoteRun, step: int, tmp: Path, check: Callable[[], object]) -> None:
    """``check()``; its :class:`VerificationError` names the object in the store, not ``tmp``."""
    try:
        check()
    except VerificationError as exc:
        rel = Path(exc.path).relative_to(tmp).as_posix() if exc.path.startswith(str(tmp)) else exc.path
        raise VerificationError(
            run.where(run.step_key(step, rel)),
            exc.reason,
            "the step is skipped; an older verified step is used",
        ) from exc


def agreed(coll: Collective, work: Callable[[], T]) -> T:
    """Collective: ``work()`` on every rank, then every rank learns whether any failed and raises if
    one did: its own exception where it failed, else the same class and line (a verification or
    store failure), or a RuntimeError naming the rank (anything else: never taken for I/O)."""
    try:
        result, failure = work(), None
    except Exception as exc:  # noqa: BLE001 - re-raised below, on this rank unchanged
        result, failure = None, exc
    reports = coll.all_gather(None if failure is None else _report(failure))
    if failure is not None:
        raise failure
    bad = next(((r, rep) for r, rep in enumerate(reports) if rep is not None), None)
    if bad is not None:
        raise _from_report(*bad)
    return result  # type: ignore[return-value]


def _report(exc: Exception) -> tuple[str, str, str, str]:
    if isinstance(exc, VerificationError):
        return ("verification", exc.path, exc.reason, exc.fix)
    if isinstance(exc, ObjectStoreError):
        return ("store", str(exc), "", "")
    return ("other", f"{type(exc).__name__}: {exc}", "", "")


def _from_report(rank: int, report: tuple[str, str, str, str]) -> Exception:
    kind, first, reason, fix = report
    if kind == "verification":
        return VerificationError(first, reason, fix)
    if kind == "store":
        return ObjectStoreError(f"rank {rank}: {first}")
    return RuntimeError(f"S3 restore failed on rank {rank} ({first}); fix: see that rank's log")


def restore_newest(
    run: RemoteRun,
    layout: RunLayout,
    attempt: str,
    exclude: set[int] | frozenset[int] = frozenset(),
    coll: Collective | None = None,
) -> tuple[int | None, list[tuple[int, str]]]:
    """Newest committed step that verifies, downloaded into ``layout``; older ones on any mismatch.
    ``exclude``: steps known to be bad although they verify (poisoned checkpoints). With ``coll``
    (collective) rank 0 lists the steps and every rank downloads its share of each tried."""
    coll = coll or SingleProcess()
    rejected: list[tuple[int, str]] = []
    committed = agreed(coll, lambda: _committed(run) if coll.rank == 0 else None)
    committed = coll.broadcast(committed)
    for step in committed:
        if step in exclude:
            rejected.append((step, "marked suspect (poisoned checkpoint)"))
            continue
        try:
            download_step(run, step, layout, attempt, coll)
            return step, rejected
        except VerificationError as exc:
            log.error("S3 step rejected: %s", exc)
            rejected.append((step, str(exc)))
    return None, rejected


def _committed(run: RemoteRun) -> list[int]:
    """The committed steps, newest first (a ``latest.json`` naming another is only logged)."""
    hint = latest_hint(run)
    committed = run.committed_steps()
    if hint is not None and hint not in committed:
        log.warning(
            "%s names step %s, which is not committed; ignoring the hint", run.where(run.key("latest.json")), hint
        )
    return committed


def _fetch_whole(run: RemoteRun, step: int, tmp: Path, files: list[FileEntry]) -> None:
    def fetch(rel: str) -> None:
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        run.store.download_file(run.step_key(step, rel), dst)

    with ThreadPoolExecutor(max_workers=run.download_concurrency) as pool:
        list(pool.map(fetch, [f.path for f in files]))


def _fetch_chunks(run: RemoteRun, step: int, tmp: Path, files: list[FileEntry]) -> None:
    """Ranged GETs of every chunk, ``download_concurrency`` at a time, each hashed and written
    piece by piece as it arrives; the first bad chunk fails the step, naming object and chunk,
    and the chunks not yet started are dropped. Bytes land in ``tmp`` before their chunk is
    checked: nothing there is read until the whole step has verified and is published, and a
    failed step's ``tmp`` is removed."""
    fds: dict[str, int] = {}
    bad: tuple[str, str] | None = None
    try:
        for entry in files:
            dst = tmp / entry.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            fds[entry.path] = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(fds[entry.path], entry.bytes)
        with ThreadPoolExecutor(max_workers=run.download_concurrency) as pool:
            futures = [
                (entry.path, pool.submit(_fetch_chunk, run, step, entry, index, fds[entry.path]))
                for entry in files
                for index in range(len(entry.chunks))
            ]
            try:
                bad = _first_bad(futures)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)  # after a bad chunk or an error: stop
    finally:
        for fd in fds.values():
            os.close(fd)
    if bad is not None:
        raise VerificationError(
            run.where(run.step_key(step, bad[0])), bad[1], "the step is skipped; an older verified step is used"
        )


def _fetch_chunk(run: RemoteRun, step: int, entry: FileEntry, index: int, fd: int) -> str | None:
    """Chunk ``index`` of ``entry`` into ``fd`` at its offset; what is wrong with it, or None.
    A body that breaks off is asked for again from the chunk's start (``FETCH_ATTEMPTS`` in
    all, as boto3's ``download_file`` retries a part), with a fresh hash."""
    start, length = chunk_range(index, entry.bytes, entry.chunk_bytes)
    for attempt in range(1, FETCH_ATTEMPTS + 1):
        hasher = new_hasher(entry.hash)
        offset = start
        try:
            for piece in run.store.iter_range(run.step_key(step, entry.path), start, length):
                piece = piece[: start + length - offset]  # a server that overruns the range cannot write past it
                hasher.update(piece)
                os.pwrite(fd, piece, offset)
                offset += len(piece)
                if offset == start + length:
                    break
            break
        except ObjectNotFound:
            return f"chunk {index}: object is missing (the manifest lists it)"
        except TransferInterrupted as exc:
            if attempt == FETCH_ATTEMPTS:
                raise
            log.warning("%s; chunk %s asked for again (attempt %s of %s)", exc, index, attempt + 1, FETCH_ATTEMPTS)
    received = offset - start
    if received != length:
        return f"chunk {index}: {received} bytes received, {length} expected (truncated)"
    if hasher.hexdigest() != entry.chunks[index]:
        return bad_chunk_reason(index, len(entry.chunks), entry.bytes, entry.chunk_bytes)
    return None


def _first_bad(futures: list[tuple[str, Future[str | None]]]) -> tuple[str, str] | None:
    """(file, reason) of the first chunk, in order, whose fetch found something wrong."""
    for rel, future in futures:
        reason = future.result()
        if reason is not None:
            return rel, reason
    return None
