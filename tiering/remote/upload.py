"""Upload of a published local step to an object store, and the ``latest.json`` hint.

Order: the local step's ``SIGNATURE`` checked (a signed run: a step without a good one is never
uploaded), every object (resumable: one already there with the right size and digest is kept), a
size check of each, ``SIGNATURE``, ``manifest.json``, ``COMMITTED`` (bound to the manifest), then
``latest.json`` (a conditional write: it never moves back). The local step is verified while its objects upload; a
step that fails is never committed (its objects stay uncommitted garbage for GC). Called by
:class:`tiering.remote.tier.RemoteTier` (the uploader, benchmarks); it never deletes an object.

A committed step is never overwritten: a step already committed with the same manifest is done (an
uploader that died after its commit), one committed with another manifest is refused
(:class:`tiering.errors.AlreadyCommitted`) before any object is written, and the ``COMMITTED`` marker is
a conditional write (``If-None-Match: *``): of two writers racing for a step (the lease allows one per run)
only one commits, and the other reports it (their objects may already have mixed).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tiering.errors import AlreadyCommitted, CheckpointError, ObjectNotFound, VerificationError
from tiering.layout import step_name
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, Manifest
from tiering.remote.objectstore import PreconditionFailed
from tiering.remote.run import RemoteRun
from tiering.trust.signature import SIGNATURE_NAME, read_signature
from tiering.verify import committed_marker, read_manifest, verify_step

LATEST_NAME = "latest.json"


@dataclass
class UploadResult:
    step: int
    bytes: int
    seconds: float
    skipped_objects: int = 0


def upload_step(run: RemoteRun, step_dir: Path) -> UploadResult:
    """Upload one verified local step (see the module docstring for the order)."""
    t0 = time.perf_counter()
    manifest = read_manifest(step_dir, run.signer)  # the signature first: nothing is read or sent before
    if manifest.run_id != run.run_id:
        raise VerificationError(
            step_dir / MANIFEST_NAME, f"manifest belongs to run {manifest.run_id!r}, not {run.run_id!r}"
        )
    raw = (step_dir / MANIFEST_NAME).read_bytes()
    signature = read_signature(step_dir)
    if run.signer is not None:  # the bytes uploaded are the bytes checked (not an earlier read)
        run.signer.check(raw, signature, step_dir / SIGNATURE_NAME)
    step = manifest.step
    if _committed_already(run, step, raw):
        update_latest(run, step)
        return UploadResult(step, manifest.total_bytes, time.perf_counter() - t0, len(manifest.files))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-upload") as checker:
        verified = checker.submit(
            verify_step, step_dir, expect_run_id=run.run_id, expect_hash=run.expect_hash, signer=run.signer
        )
        skipped = _put_objects(run, step_dir, manifest)
        verified.result()  # raises VerificationError: nothing below happens
    for entry in manifest.files:
        info = run.store.head(run.step_key(step, entry.path))
        if info is None or info.size != entry.bytes:
            raise CheckpointError(
                f"{run.where(run.step_key(step, entry.path))}: uploaded object has size "
                f"{info.size if info else 'missing'}, manifest says {entry.bytes}; retrying"
            )
    if signature is not None:  # checked above when this run is signed; carried as it is otherwise
        run.store.put_bytes(run.step_key(step, SIGNATURE_NAME), signature)
    run.store.put_bytes(run.step_key(step, MANIFEST_NAME), raw)
    marker = committed_marker(step, raw)
    try:
        run.store.put_bytes(run.step_key(step, COMMITTED_NAME), marker, if_none_match=True)
    except PreconditionFailed:  # another writer committed it between our check and now
        # Its marker binds the manifest it committed (ours may have replaced manifest.json since).
        theirs, _ = run.store.get_bytes(run.step_key(step, COMMITTED_NAME))
        if theirs != marker:
            raise AlreadyCommitted(
                run.where(run.step_key(step, COMMITTED_NAME)),
                f"step {step} was committed by another writer during this upload",
                "fix: run one uploader per run (the lease); check the step with 'tiering verify'",
            ) from None
    update_latest(run, step)
    return UploadResult(step, manifest.total_bytes, time.perf_counter() - t0, skipped)


def _committed_already(run: RemoteRun, step: int, raw: bytes) -> bool:
    """Whether ``step`` is committed in the store with the manifest ``raw`` (then nothing is left to
    do); raises AlreadyCommitted if it is committed with another one."""
    if run.store.head(run.step_key(step, COMMITTED_NAME)) is None:
        return False
    try:
        theirs, _ = run.store.get_bytes(run.step_key(step, MANIFEST_NAME))
    except ObjectNotFound:
        theirs = b""
    if theirs == raw:
        return True
    raise AlreadyCommitted(
        run.where(run.step_key(step, COMMITTED_NAME)),
        f"step {step} is already committed there with another manifest; an upload never overwrites a committed step",
        "fix: keep the committed step (delete it with its run's retention tools if it is bad, then upload again)",
    )


def _put_objects(run: RemoteRun, step_dir: Path, manifest: Manifest) -> int:
    """Upload every file of the step; returns how many were already there (same size and digest)."""
    existing = {o.key for o in run.store.list(run.step_key(manifest.step) + "/")}
    skipped = 0
    for entry in manifest.files:
        key = run.step_key(manifest.step, entry.path)
        have = run.store.head(key) if key in existing else None
        if have is not None and have.size == entry.bytes and have.digest == entry.identity:
            skipped += 1  # left by an interrupted upload of this same step: keep it
            continue
        run.store.put_file(key, step_dir / entry.path, entry.identity)
    return skipped


def update_latest(run: RemoteRun, step: int, attempts: int = 5) -> None:
    """Point latest.json at ``step`` unless it already names a newer one (conditional write)."""
    key = run.key(LATEST_NAME)
    body = json.dumps({"step": step, "path": f"steps/{step_name(step)}"}).encode()
    for _ in range(attempts):
        try:
            raw, etag = run.store.get_bytes(key)
        except ObjectNotFound:
            try:
                run.store.put_bytes(key, body, if_none_match=True)
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
            run.store.put_bytes(key, body, if_match=etag)
            return
        except PreconditionFailed:
            continue  # another writer moved it: re-read and decide again
    raise CheckpointError(f"{run.where(key)}: could not update after {attempts} conflicting writers")


def latest_hint(run: RemoteRun) -> int | None:
    """The step latest.json names, or None (absent or unreadable: it is only a hint)."""
    try:
        raw, _ = run.store.get_bytes(run.key(LATEST_NAME))
    except ObjectNotFound:
        return None
    try:
        step = json.loads(raw)["step"]
    except (KeyError, ValueError, TypeError):  # only a hint: an unreadable one is ignored
        return None
    return step if isinstance(step, int) else None
