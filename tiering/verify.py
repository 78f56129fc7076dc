"""Verification of a published step: marker, manifest, paths, sizes and the digest of every byte.

Every chunk of a v2 file is read once and hashed on several threads (:func:`tiering.digest.check_file`);
a v1 file is hashed whole with SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tiering.digest import check_file, short_file_reason
from tiering.errors import VerificationError
from tiering.layout import parse_step_name
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, FileEntry, Manifest
from tiering.system.fsio import sha256_file
from tiering.trust.signature import SIGNATURE_NAME, ManifestSigner, read_signature

# Hashing threads per verifying process: the restore is on the critical path, the cores are free.
VERIFY_THREADS = max(1, os.cpu_count() or 1)


def committed_marker(step: int, manifest_bytes: bytes) -> bytes:
    """The ``COMMITTED`` content binds the marker to exactly one manifest."""
    body = {"step": step, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
    return (json.dumps(body, sort_keys=True) + "\n").encode()


def read_manifest(step_dir: Path, signer: ManifestSigner | None = None) -> Manifest:
    """Check the marker and the manifest of ``step_dir`` without hashing the data files; with
    ``signer``, its ``SIGNATURE`` first (before the manifest is even parsed)."""
    step_dir = Path(step_dir)
    if step_dir.is_symlink() or not step_dir.is_dir():
        raise VerificationError(step_dir, "step directory is missing or is a symlink")
    marker = step_dir / COMMITTED_NAME
    manifest_path = step_dir / MANIFEST_NAME
    if marker.is_symlink() or not marker.is_file():
        raise VerificationError(marker, "COMMITTED marker is missing: the save never finished publishing")
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise VerificationError(manifest_path, "manifest.json is missing")
    raw = manifest_path.read_bytes()
    if signer is not None:
        signer.check(raw, read_signature(step_dir), step_dir / SIGNATURE_NAME)
    manifest = Manifest.from_json(raw, manifest_path)
    try:
        marker_body = json.loads(marker.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerificationError(marker, "COMMITTED marker is not valid JSON") from exc
    if marker.read_bytes() != committed_marker(manifest.step, raw) or not isinstance(marker_body, dict):
        raise VerificationError(marker, "COMMITTED marker does not match manifest.json (manifest changed after commit)")
    dir_step = parse_step_name(step_dir.name)
    if dir_step is not None and dir_step != manifest.step:
        raise VerificationError(manifest_path, f"manifest says step {manifest.step} but directory is {step_dir.name}")
    return manifest


def verify_step(
    step_dir: Path,
    *,
    expect_run_id: str | None = None,
    shard: tuple[int, int] = (0, 1),
    hash_files: bool = True,
    threads: int = VERIFY_THREADS,
    expect_hash: str | None = None,
    signer: ManifestSigner | None = None,
) -> Manifest:
    """Verify ``step_dir`` and return its manifest, or raise :class:`VerificationError`.

    ``shard=(i, n)`` hashes only every n-th listed file starting at i, so that n ranks can verify
    one step in parallel (each with ``threads`` hashing threads); the structural checks (marker,
    manifest, symlinks, unlisted or missing files, sizes) always cover the whole step.
    ``expect_hash``: the tier's one digest; a file listed with another (a manifest that chose a
    weaker hash for itself) is refused before anything is hashed. ``signer``: the tier's steps
    are signed (:mod:`tiering.trust.signature`); a missing or forged ``SIGNATURE`` is refused before
    anything else is checked.
    """
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir, signer)
    if expect_hash is not None:
        for entry in manifest.files:
            if entry.hash != expect_hash:
                raise VerificationError(
                    step_dir / MANIFEST_NAME,
                    f"{entry.path} is hashed with {entry.hash or 'sha256 (v1)'}, this tier reads {expect_hash} only",
                )
    if expect_run_id is not None and manifest.run_id != expect_run_id:
        raise VerificationError(
            step_dir / MANIFEST_NAME, f"manifest belongs to run {manifest.run_id!r}, not {expect_run_id!r}"
        )
    listed = {f.path: f for f in manifest.files}
    present: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(step_dir):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            if full.is_symlink():
                raise VerificationError(full, "symlink inside a step directory")
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(step_dir).as_posix()
            if rel in (MANIFEST_NAME, COMMITTED_NAME, SIGNATURE_NAME):
                continue
            if rel not in listed:
                raise VerificationError(step_dir / rel, "file is not listed in manifest.json")
            present.add(rel)
    ordered = sorted(listed)
    for index, rel in enumerate(ordered):
        entry = listed[rel]
        path = step_dir / rel
        if rel not in present:
            raise VerificationError(path, "file listed in manifest.json is missing (lost shard)")
        size = path.stat().st_size
        expected = entry.chunked
        if size != entry.bytes:
            reason = short_file_reason(size, expected) if expected else f"size {size} != {entry.bytes} in manifest"
            raise VerificationError(path, f"{reason} (truncated or extended)")
        if hash_files and index % shard[1] == shard[0]:
            verify_file(path, entry, threads)
    return manifest


def verify_file(path: Path, entry: FileEntry, threads: int = VERIFY_THREADS) -> None:
    """Check one file's bytes against its manifest entry (chunked v2, or v1's whole SHA-256)."""
    expected = entry.chunked
    if expected is not None:
        check_file(path, expected, threads)
        return
    _, digest = sha256_file(path)
    if digest != entry.sha256:
        raise VerificationError(path, "SHA-256 does not match manifest (corrupted bytes)")
