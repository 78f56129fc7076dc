"""Verified download of a step from an object store, and restore of the newest one that verifies.

A step is read only once its ``COMMITTED`` object matches its manifest. Format v2: every digest
chunk is one ranged GET, hashed and written at its offset piece by piece as it arrives (several in
parallel, a body that breaks off asked for again); nothing is read back. Format v1: whole objects,
then one SHA-256 pass. Bytes land in a temporary directory and are published locally (the same
atomic rename as a local save) only after every byte verified; a step that fails is reported as a
:class:`VerificationError` naming the object and chunk, and an older step is tried. A missing
object is :class:`ObjectNotFound` from the store, caught around that one request only. Called by
:class:`tiering.remote.tier.RemoteTier` (the trainer's restore, ``tiering restore``, ``pretrain
evaluate``); it never writes to the store.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tiering.digest import bad_chunk_reason, chunk_range, new_hasher
from tiering.errors import ObjectNotFound, TransferInterrupted, VerificationError
from tiering.layout import RunLayout
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest
from tiering.publish import publish_dir
from tiering.remote.run import RemoteRun
from tiering.remote.upload import latest_hint
from tiering.verify import committed_marker, verify_step

log = logging.getLogger(__name__)
FETCH_ATTEMPTS = 3  # requests per chunk when its body breaks off mid-way (reset, read timeout)


def read_remote_manifest(run: RemoteRun, step: int) -> tuple[Manifest, bytes]:
    """The committed manifest of ``step`` and its raw bytes; :class:`VerificationError` if the step is not committed
    or its ``COMMITTED`` does not match."""
    where = run.where(run.step_key(step, MANIFEST_NAME))
    # Two independent small GETs, sent together: a restore waits one first-byte latency of the
    # store for them, not two.
    with ThreadPoolExecutor(max_workers=2) as pool:
        marker_get = pool.submit(run.store.get_bytes, run.step_key(step, COMMITTED_NAME))
        manifest_get = pool.submit(run.store.get_bytes, run.step_key(step, MANIFEST_NAME))
    try:
        marker, _ = marker_get.result()
    except ObjectNotFound as exc:
        raise VerificationError(
            run.where(run.step_key(step, COMMITTED_NAME)),
            "COMMITTED object is missing: the upload never finished",
        ) from exc
    try:
        raw, _ = manifest_get.result()
    except ObjectNotFound as exc:
        raise VerificationError(where, "manifest.json object is missing") from exc
    manifest = Manifest.from_json(raw, where)
    if marker != committed_marker(step, raw):
        raise VerificationError(
            run.where(run.step_key(step, COMMITTED_NAME)),
            "COMMITTED does not match manifest.json (manifest changed after commit)",
        )
    if manifest.step != step or manifest.run_id != run.run_id:
        raise VerificationError(where, f"manifest names run {manifest.run_id!r} step {manifest.step}")
    return manifest, raw


def download_step(run: RemoteRun, step: int, layout: RunLayout, attempt: str) -> Path:
    """Download, verify every byte, and publish the step locally under ``layout``.

    Format v2: every digest chunk is one ranged GET, hashed and written at its offset piece by
    piece as it arrives (several in parallel); nothing is read back. Format v1: whole objects,
    then one SHA-256 pass.
    """
    manifest, raw = read_remote_manifest(run, step)
    final = layout.step_dir(step)
    if final.exists():
        try:
            verify_step(final, expect_run_id=run.run_id)
            return final  # already here and good
        except VerificationError:
            shutil.rmtree(final)
    tmp = layout.tmp_dir(step, attempt)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        chunked = all(f.chunked is not None for f in manifest.files)
        if chunked:
            _fetch_chunks(run, step, tmp, manifest)
        else:
            _fetch_whole(run, step, tmp, manifest)
        (tmp / MANIFEST_NAME).write_bytes(raw)
        (tmp / COMMITTED_NAME).write_bytes(committed_marker(step, raw))
        try:
            verify_step(tmp, expect_run_id=run.run_id, hash_files=not chunked)
        except VerificationError as exc:
            rel = Path(exc.path).relative_to(tmp).as_posix() if exc.path.startswith(str(tmp)) else exc.path
            raise VerificationError(
                run.where(run.step_key(step, rel)),
                exc.reason,
                "the step is skipped; an older verified step is used",
            ) from exc
        # The same publish as a local save (atomic rename, COMMITTED, latest.json), minus the
        # fsync of the data: the object store keeps its copy; a copy torn by a crash fails its
        # digests at the next restore and is fetched again.
        publish_dir(layout, tmp, step, raw, durable=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def restore_newest(
    run: RemoteRun, layout: RunLayout, attempt: str, exclude: set[int] | frozenset[int] = frozenset()
) -> tuple[int | None, list[tuple[int, str]]]:
    """Newest committed step that verifies, downloaded into ``layout``; older ones on any mismatch.
    ``exclude``: steps known to be bad although they verify (poisoned checkpoints)."""
    rejected: list[tuple[int, str]] = []
    hint = latest_hint(run)
    committed = run.committed_steps()
    if hint is not None and hint not in committed:
        log.warning(
            "%s names step %s, which is not committed; ignoring the hint", run.where(run.key("latest.json")), hint
        )
    for step in committed:
        if step in exclude:
            rejected.append((step, "marked suspect (poisoned checkpoint)"))
            continue
        try:
            download_step(run, step, layout, attempt)
            return step, rejected
        except VerificationError as exc:
            log.error("S3 step rejected: %s", exc)
            rejected.append((step, str(exc)))
    return None, rejected


def _fetch_whole(run: RemoteRun, step: int, tmp: Path, manifest: Manifest) -> None:
    def fetch(rel: str) -> None:
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        run.store.download_file(run.step_key(step, rel), dst)

    with ThreadPoolExecutor(max_workers=run.download_concurrency) as pool:
        list(pool.map(fetch, [f.path for f in manifest.files]))


def _fetch_chunks(run: RemoteRun, step: int, tmp: Path, manifest: Manifest) -> None:
    """Ranged GETs of every chunk, ``download_concurrency`` at a time, each hashed and written
    piece by piece as it arrives; the first bad chunk fails the step, naming object and chunk,
    and the chunks not yet started are dropped. Bytes land in ``tmp`` before their chunk is
    checked: nothing there is read until the whole step has verified and is published, and a
    failed step's ``tmp`` is removed."""
    fds: dict[str, int] = {}
    bad: tuple[str, str] | None = None
    try:
        for entry in manifest.files:
            dst = tmp / entry.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            fds[entry.path] = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(fds[entry.path], entry.bytes)
        with ThreadPoolExecutor(max_workers=run.download_concurrency) as pool:
            futures = [
                (entry.path, pool.submit(_fetch_chunk, run, step, entry, index, fds[entry.path]))
                for entry in manifest.files
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
