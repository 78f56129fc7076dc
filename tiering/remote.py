"""Tier 3: verified steps in an object store (S3, or ``file://`` with the same protocol).

Keys under ``<prefix>/<run id>/``::

    run.json                               the run lease: the first writer's identity (If-None-Match: *)
    steps/step-000000123/<file>            immutable objects: chunk digests in our manifest (the hash it
                                           names: BLAKE3 for promoted steps; v1: one SHA-256), the whole
                                           digest tagged with its hash in the object's metadata
    steps/step-000000123/manifest.json     uploaded after every object's size was checked
    steps/step-000000123/COMMITTED         last, bound to the manifest's SHA-256
    latest.json                            a hint, replaced with If-Match so two writers cannot both win
    gc/marks.json                          steps marked for deletion by an earlier GC pass

Object stores have no rename: a step exists for readers only once ``COMMITTED`` does, and a reader
verifies every byte against the manifest before using it.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tiering.digest import bad_chunk_reason, chunk_range, new_hasher
from tiering.errors import (
    AccessDenied,
    CheckpointError,
    LeaseError,
    ObjectNotFound,
    TransferInterrupted,
    VerificationError,
)
from tiering.layout import RunLayout, parse_step_name, step_name
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest
from tiering.objectstore import ObjectStore, PreconditionFailed, open_store
from tiering.publish import publish_dir
from tiering.retention import ObjectStoreRetention, StepView
from tiering.store_faults import install_s3_faults
from tiering.verify import committed_marker, read_manifest, verify_step

log = logging.getLogger(__name__)
FETCH_ATTEMPTS = 3  # requests per chunk when its body breaks off mid-way (reset, read timeout)


def default_owner() -> str:
    """The lease identity when none is given: ``RP_RUN_OWNER``, else ``user@host``."""
    return os.environ.get("RP_RUN_OWNER") or f"{getpass.getuser()}@{socket.gethostname()}"


@dataclass
class UploadResult:
    step: int
    bytes: int
    seconds: float
    skipped_objects: int = 0


@dataclass
class GcPlan:
    keep: list[int]
    marked_now: list[int]
    deleted: list[int]
    reasons: dict[int, str] = field(default_factory=dict)


class RemoteTier:
    name = "s3"

    def __init__(self, store: ObjectStore, prefix: str, run_id: str, download_concurrency: int = 8) -> None:
        self.store = store
        self.run_id = run_id
        self.base = "/".join(p for p in (prefix.strip("/"), run_id) if p)
        self.download_concurrency = download_concurrency

    @classmethod
    def open(
        cls,
        uri: str,
        run_id: str,
        *,
        endpoint_url: str | None = None,
        concurrency: int = 8,
        multipart_chunk_mb: int = 64,
        checksum_header: bool = False,
        fault: str | None = None,
        max_attempts: int = 5,
    ) -> RemoteTier:
        """The run ``run_id`` under ``uri`` (``s3://bucket/prefix`` or ``file:///path``); ``fault``
        injects deliberate S3 faults (tests and drills only); ``max_attempts``: the S3 client's tries
        per request before the error reaches the caller (whose own backoff then applies)."""
        store, prefix = open_store(
            uri, endpoint_url, concurrency, multipart_chunk_mb, checksum_header, max_attempts=max_attempts
        )
        if fault:
            install_s3_faults(store, fault)
        return cls(store, prefix, run_id, concurrency)

    # -- keys ------------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def step_key(self, step: int, rel: str = "") -> str:
        return self.key("steps", step_name(step), rel) if rel else self.key("steps", step_name(step))

    def where(self, key: str) -> str:
        return f"{self.store.url}/{key}"

    # -- lease -----------------------------------------------------------------------------------
    def acquire_lease(self, identity: str) -> None:
        """Create ``run.json`` for ``identity`` or confirm it already owns the run."""
        body = json.dumps(
            {"run_id": self.run_id, "owner": identity, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        ).encode()
        try:
            self.store.put_bytes(self.key("run.json"), body, if_none_match=True)
            log.info("%s: run lease created for %s", self.where(self.key("run.json")), identity)
            return
        except PreconditionFailed:
            pass
        except AccessDenied:
            pass  # a read-only identity (the trainer's role): it can check a lease, not create one
        try:
            raw, _ = self.store.get_bytes(self.key("run.json"))
        except ObjectNotFound:
            log.info("%s: no run lease yet; the uploader's identity creates it", self.where(self.key("run.json")))
            return
        try:
            owner = json.loads(raw)["owner"]
        except (ValueError, KeyError) as exc:
            raise LeaseError(
                f"{self.where(self.key('run.json'))}: unreadable run lease; fix: inspect it, or use a new run.id"
            ) from exc
        if owner != identity:
            raise LeaseError(
                f"{self.where(self.key('run.json'))}: run {self.run_id!r} is owned by {owner!r}, "
                f"not {identity!r}; refusing to write; fix: use a new run.id or run as the owner"
            )

    # -- upload ----------------------------------------------------------------------------------
    def upload_step(self, step_dir: Path) -> UploadResult:
        """Upload one verified local step; resumable (objects already there with the right size
        and digest are kept). Order: objects, size check, manifest, COMMITTED, latest.json.

        The local step is verified (every chunk, on every core) while its objects upload, not
        before: a step that fails is never committed (its objects stay uncommitted garbage for GC).
        """
        t0 = time.perf_counter()
        manifest = read_manifest(step_dir)
        if manifest.run_id != self.run_id:
            raise VerificationError(
                step_dir / MANIFEST_NAME, f"manifest belongs to run {manifest.run_id!r}, not {self.run_id!r}"
            )
        raw = (step_dir / MANIFEST_NAME).read_bytes()
        step = manifest.step
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-upload") as checker:
            verified = checker.submit(verify_step, step_dir, expect_run_id=self.run_id)
            skipped = self._put_objects(step_dir, manifest)
            verified.result()  # raises VerificationError: nothing below happens
        for entry in manifest.files:
            info = self.store.head(self.step_key(step, entry.path))
            if info is None or info.size != entry.bytes:
                raise CheckpointError(
                    f"{self.where(self.step_key(step, entry.path))}: uploaded object has size "
                    f"{info.size if info else 'missing'}, manifest says {entry.bytes}; retrying"
                )
        self.store.put_bytes(self.step_key(step, MANIFEST_NAME), raw)
        self.store.put_bytes(self.step_key(step, COMMITTED_NAME), committed_marker(step, raw))
        self.update_latest(step)
        return UploadResult(step, manifest.total_bytes, time.perf_counter() - t0, skipped)

    def _put_objects(self, step_dir: Path, manifest: Manifest) -> int:
        """Upload every file of the step; returns how many were already there (same size and digest)."""
        existing = {o.key for o in self.store.list(self.step_key(manifest.step) + "/")}
        skipped = 0
        for entry in manifest.files:
            key = self.step_key(manifest.step, entry.path)
            have = self.store.head(key) if key in existing else None
            if have is not None and have.size == entry.bytes and have.digest == entry.identity:
                skipped += 1  # left by an interrupted upload of this same step: keep it
                continue
            self.store.put_file(key, step_dir / entry.path, entry.identity)
        return skipped

    def update_latest(self, step: int, attempts: int = 5) -> None:
        """Point latest.json at ``step`` unless it already names a newer one (conditional write)."""
        key = self.key("latest.json")
        body = json.dumps({"step": step, "path": f"steps/{step_name(step)}"}).encode()
        for _ in range(attempts):
            try:
                raw, etag = self.store.get_bytes(key)
            except ObjectNotFound:
                try:
                    self.store.put_bytes(key, body, if_none_match=True)
                    return
                except PreconditionFailed:
                    continue
            try:
                current = int(json.loads(raw)["step"])
            except (ValueError, KeyError, TypeError):
                current = -1
            if current >= step:
                return
            try:
                self.store.put_bytes(key, body, if_match=etag)
                return
            except PreconditionFailed:
                continue  # another writer moved it: re-read and decide again
        raise CheckpointError(f"{self.where(key)}: could not update after {attempts} conflicting writers")

    def latest_hint(self) -> int | None:
        try:
            raw, _ = self.store.get_bytes(self.key("latest.json"))
        except ObjectNotFound:
            return None
        try:
            step = json.loads(raw)["step"]
        except (KeyError, ValueError, TypeError):  # only a hint: an unreadable one is ignored
            return None
        return step if isinstance(step, int) else None

    # -- listing ---------------------------------------------------------------------------------
    def steps(self) -> dict[int, set[str]]:
        """step -> relative object names present (any state), from one listing."""
        out: dict[int, set[str]] = {}
        prefix = self.key("steps") + "/"
        for obj in self.store.list(prefix):
            rest = obj.key[len(prefix) :]
            name, _, rel = rest.partition("/")
            step = parse_step_name(name)
            if step is not None and rel:
                out.setdefault(step, set()).add(rel)
        return out

    def committed_steps(self) -> list[int]:
        return sorted((s for s, names in self.steps().items() if COMMITTED_NAME in names), reverse=True)

    # -- download / restore ----------------------------------------------------------------------
    def read_manifest(self, step: int) -> tuple[Manifest, bytes]:
        where = self.where(self.step_key(step, MANIFEST_NAME))
        # Two independent small GETs, sent together: a restore waits one first-byte latency of the
        # store for them, not two.
        with ThreadPoolExecutor(max_workers=2) as pool:
            marker_get = pool.submit(self.store.get_bytes, self.step_key(step, COMMITTED_NAME))
            manifest_get = pool.submit(self.store.get_bytes, self.step_key(step, MANIFEST_NAME))
        try:
            marker, _ = marker_get.result()
        except ObjectNotFound as exc:
            raise VerificationError(
                self.where(self.step_key(step, COMMITTED_NAME)),
                "COMMITTED object is missing: the upload never finished",
            ) from exc
        try:
            raw, _ = manifest_get.result()
        except ObjectNotFound as exc:
            raise VerificationError(where, "manifest.json object is missing") from exc
        manifest = Manifest.from_json(raw, where)
        if marker != committed_marker(step, raw):
            raise VerificationError(
                self.where(self.step_key(step, COMMITTED_NAME)),
                "COMMITTED does not match manifest.json (manifest changed after commit)",
            )
        if manifest.step != step or manifest.run_id != self.run_id:
            raise VerificationError(where, f"manifest names run {manifest.run_id!r} step {manifest.step}")
        return manifest, raw

    def download_step(self, step: int, layout: RunLayout, attempt: str) -> Path:
        """Download, verify every byte, and publish the step locally under ``layout``.

        Format v2: every digest chunk is one ranged GET, hashed and written at its offset piece by
        piece as it arrives (several in parallel); nothing is read back. Format v1: whole objects,
        then one SHA-256 pass.
        """
        manifest, raw = self.read_manifest(step)
        final = layout.step_dir(step)
        if final.exists():
            try:
                verify_step(final, expect_run_id=self.run_id)
                return final  # already here and good
            except VerificationError:
                shutil.rmtree(final)
        tmp = layout.tmp_dir(step, attempt)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            chunked = all(f.chunked is not None for f in manifest.files)
            if chunked:
                self._fetch_chunks(step, tmp, manifest)
            else:
                self._fetch_whole(step, tmp, manifest)
            (tmp / MANIFEST_NAME).write_bytes(raw)
            (tmp / COMMITTED_NAME).write_bytes(committed_marker(step, raw))
            try:
                verify_step(tmp, expect_run_id=self.run_id, hash_files=not chunked)
            except VerificationError as exc:
                rel = Path(exc.path).relative_to(tmp).as_posix() if exc.path.startswith(str(tmp)) else exc.path
                raise VerificationError(
                    self.where(self.step_key(step, rel)),
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

    def _fetch_whole(self, step: int, tmp: Path, manifest: Manifest) -> None:
        def fetch(rel: str) -> None:
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.store.download_file(self.step_key(step, rel), dst)

        with ThreadPoolExecutor(max_workers=self.download_concurrency) as pool:
            list(pool.map(fetch, [f.path for f in manifest.files]))

    def _fetch_chunks(self, step: int, tmp: Path, manifest: Manifest) -> None:
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
            with ThreadPoolExecutor(max_workers=self.download_concurrency) as pool:
                futures = [
                    (entry.path, pool.submit(self._fetch_chunk, step, entry, index, fds[entry.path]))
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
                self.where(self.step_key(step, bad[0])), bad[1], "the step is skipped; an older verified step is used"
            )

    def _fetch_chunk(self, step: int, entry: FileEntry, index: int, fd: int) -> str | None:
        """Chunk ``index`` of ``entry`` into ``fd`` at its offset; what is wrong with it, or None.
        A body that breaks off is asked for again from the chunk's start (``FETCH_ATTEMPTS`` in
        all, as boto3's ``download_file`` retries a part), with a fresh hash."""
        start, length = chunk_range(index, entry.bytes, entry.chunk_bytes)
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            hasher = new_hasher(entry.hash)
            offset = start
            try:
                for piece in self.store.iter_range(self.step_key(step, entry.path), start, length):
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

    def restore_newest(
        self, layout: RunLayout, attempt: str, exclude: set[int] | frozenset[int] = frozenset()
    ) -> tuple[int | None, list[tuple[int, str]]]:
        """Newest committed step that verifies, downloaded into ``layout``; older ones on any mismatch.
        ``exclude``: steps known to be bad although they verify (poisoned checkpoints)."""
        rejected: list[tuple[int, str]] = []
        hint = self.latest_hint()
        committed = self.committed_steps()
        if hint is not None and hint not in committed:
            log.warning(
                "%s names step %s, which is not committed; ignoring the hint", self.where(self.key("latest.json")), hint
            )
        for step in committed:
            if step in exclude:
                rejected.append((step, "marked suspect (poisoned checkpoint)"))
                continue
            try:
                self.download_step(step, layout, attempt)
                return step, rejected
            except VerificationError as exc:
                log.error("S3 step rejected: %s", exc)
                rejected.append((step, str(exc)))
        return None, rejected

    # -- retention -------------------------------------------------------------------------------
    def gc(self, keep: int, milestone_every: int, dry_run: bool = True) -> GcPlan:
        """Mark, then (on a later pass) delete steps beyond :class:`ObjectStoreRetention`.

        Kept: the newest ``keep`` committed steps whose manifest verifies, the verified step just
        before them, milestones (``step % milestone_every == 0``), and the step latest.json names.
        Never the only verified step. Uncommitted leftovers older than the newest committed step
        are garbage too (newer ones may be uploads in progress).
        """
        all_steps = self.steps()
        verified = [s for s in sorted(all_steps, reverse=True) if self._manifest_verifies(s, all_steps[s])]
        keep_set = ObjectStoreRetention(keep, milestone_every).keeps(StepView.of(verified, latest=self.latest_hint()))
        candidates = set(verified)
        if verified:
            candidates |= {s for s in all_steps if s < verified[0]}
        doomed = candidates - keep_set
        marks = self._read_marks()
        plan = GcPlan(sorted(keep_set & set(all_steps)), [], [])
        to_delete = sorted(s for s in doomed if s in marks)
        plan.marked_now = sorted(s for s in doomed if s not in marks)
        plan.deleted = to_delete
        if not dry_run:
            for step in to_delete:
                keys = [o.key for o in self.store.list(self.step_key(step) + "/")]
                # COMMITTED first: a half-deleted step is never mistaken for a committed one.
                keys.sort(key=lambda k: not k.endswith("/" + COMMITTED_NAME))
                self.store.delete(keys[:1])
                self.store.delete(keys[1:])
            remaining = {s: t for s, t in marks.items() if s in doomed and s not in to_delete}
            remaining.update({s: time.time() for s in plan.marked_now})
            self.store.put_bytes(
                self.key("gc", "marks.json"), json.dumps({str(k): v for k, v in remaining.items()}).encode()
            )
        return plan

    def _manifest_verifies(self, step: int, names: set[str]) -> bool:
        if COMMITTED_NAME not in names:
            return False
        try:
            self.read_manifest(step)
            return True
        except VerificationError:
            return False

    def _read_marks(self) -> dict[int, float]:
        try:
            raw, _ = self.store.get_bytes(self.key("gc", "marks.json"))
        except ObjectNotFound:
            return {}
        try:
            return {int(k): float(v) for k, v in json.loads(raw).items()}
        except (ValueError, AttributeError):  # unreadable marks: start marking again
            return {}


def _first_bad(futures: list[tuple[str, Future[str | None]]]) -> tuple[str, str] | None:
    """(file, reason) of the first chunk, in order, whose fetch found something wrong."""
    for rel, future in futures:
        reason = future.result()
        if reason is not None:
            return rel, reason
    return None
