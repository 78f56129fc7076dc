"""Durable file-system primitives: fsync of files and directories, atomic writes, hashing."""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

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
    """Return ``(bytes, sha256 hex)`` of a file.

    Large files are hashed through ``mmap``: the pages are hashed where the kernel reads them,
    without copying every byte into a Python buffer first (a third of the cost of a verify).
    """
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size >= HASH_BLOCK:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                mapped.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(mapped)
                try:
                    for start in range(0, size, HASH_BLOCK):
                        digest.update(view[start : start + HASH_BLOCK])
                finally:
                    view.release()
            return size, digest.hexdigest()
        size = 0
        while block := fh.read(HASH_BLOCK):
            size += len(block)
            digest.update(block)
    return size, digest.hexdigest()


class _HashingSink(io.RawIOBase):
    """A write-only file that writes to ``raw`` while another thread hashes the same bytes.

    ``hashlib`` and ``write(2)`` both release the GIL, so on two cores the digest costs no time
    beyond the write: the file is never read back to be hashed. Large buffers (tensor storages
    handed over by ``torch.save``) are hashed in place; small ones are copied, since the caller
    may reuse them.
    """

    _COPY_BELOW = 1 << 20

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self._digest = hashlib.sha256()
        self._size = 0
        self._pending: queue.Queue[memoryview | bytes | None] = queue.Queue(maxsize=64)
        self._hasher = threading.Thread(target=self._hash_loop, name="sha256", daemon=True)
        self._hasher.start()

    def _hash_loop(self) -> None:
        while (block := self._pending.get()) is not None:
            self._digest.update(block)

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self._pending.put(bytes(view) if view.nbytes < self._COPY_BELOW else view)
        written = 0
        while written < view.nbytes:
            written += self._raw.write(view[written:])
        self._size += written
        return written

    def finish(self) -> tuple[int, str]:
        """Wait for the hasher; ``(bytes, sha256 hex)`` of everything written."""
        self._pending.put(None)
        self._hasher.join()
        return self._size, self._digest.hexdigest()


def write_file_durably(path: Path, write: Callable[[IO[bytes]], object]) -> tuple[int, str]:
    """Create ``path`` with ``write(file)``, fsync it and its directory; returns its size and
    SHA-256, computed while writing (for the manifest: nothing is read back)."""
    with open(path, "xb", buffering=0) as raw:
        sink = _HashingSink(raw)
        try:
            write(sink)
        finally:
            size, digest = sink.finish()
        os.fsync(raw.fileno())
    fsync_dir(path.parent)
    return size, digest


def dir_size(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())
