"""Durable file-system primitives: fsync of files and directories, atomic writes, hashing."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

HASH_BLOCK = 8 * 1024 * 1024


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below ``root`` (and ``root`` itself), bottom-up."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or the new, never a mix.

    The temporary name is unique per call so concurrent writers never share a temp file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sha256_file(path: Path) -> tuple[int, str]:
    """Return ``(bytes, sha256 hex)`` of a file, read in large blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            block = fh.read(HASH_BLOCK)
            if not block:
                break
            size += len(block)
            digest.update(block)
    return size, digest.hexdigest()


def dir_size(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())
