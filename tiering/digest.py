"""Chunked file digests (manifest format v2): hash names, chunk lists, parallel hashing and checking.

A file's digest is a list of digests of fixed-size chunks (the last one may be shorter) plus a
whole-file digest derived from that list, so that a file can be hashed and checked a chunk at a
time on several threads, while it is written, read, received or downloaded, and a mismatch names
the chunk. Hashes, chosen by measurement on the 2-core CI machine (README, "Checkpoint I/O"):

* ``xxh3-128`` for tiers 1-2 (node-local saves and their peer replicas): ~10 GB/s per core. It
  detects the faults those copies meet (bit rot, torn or truncated writes, a wrong replica) with
  a 2^-128 miss rate; it is not a defence against someone who forges a file on the node itself.
* ``blake3`` for the reshardable tier and what it promotes to S3: cryptographic, ~2.3 GB/s per core
  (SHA-256 with SHA-NI: 1.4). A step that leaves the machines it was written on carries it.
* ``sha256`` is still read (format v1 manifests list one SHA-256 per file).

The whole-file digest is ``H(b"rp-chunks-v2" || size || chunk_bytes || every chunk digest)``: equal
files give equal digests whatever thread hashed which chunk.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import blake3
import xxhash

from tiering.errors import VerificationError
from tiering.system.hash_threads import hash_lanes
from tiering.system.page_cache import ReadAhead

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # measured: bench/suite.py --chunk-sweep (README)
LOCAL_HASH = "xxh3-128"
PORTABLE_HASH = "blake3"


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


HASHES: dict[str, Callable[[], Hasher]] = {
    "xxh3-128": xxhash.xxh3_128,
    "blake3": blake3.blake3,
    "sha256": hashlib.sha256,
}
HEX_LENGTH = {"xxh3-128": 32, "blake3": 64, "sha256": 64}


def new_hasher(name: str, where: Path | str = "<manifest>") -> Hasher:
    if name not in HASHES:
        raise VerificationError(
            where,
            f"unknown hash {name!r} (known: {', '.join(sorted(HASHES))})",
            "upgrade resilient-pretrain to read it; the step is skipped",
        )
    return HASHES[name]()


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_range(index: int, size: int, chunk_bytes: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of a ``size``-byte file."""
    start = index * chunk_bytes
    return start, min(chunk_bytes, size - start)


@dataclass(frozen=True)
class HashSpec:
    """How a writer hashes: which hash, chunk size, and at most how many threads."""

    name: str = LOCAL_HASH
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threads: int = 1


DEFAULT_HASHING = HashSpec()


@dataclass(frozen=True)
class ChunkedDigest:
    """Digests of one file: ``chunks[i]`` covers bytes ``[i*chunk_bytes, (i+1)*chunk_bytes)``."""

    hash: str
    chunk_bytes: int
    size: int
    chunks: tuple[str, ...]

    @property
    def whole(self) -> str:
        return whole_digest(self.hash, self.size, self.chunk_bytes, self.chunks)

    def to_json(self) -> dict[str, object]:
        return {"hash": self.hash, "chunk_bytes": self.chunk_bytes, "size": self.size, "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, body: dict[str, object]) -> ChunkedDigest:
        chunks = body["chunks"]
        if not isinstance(chunks, list):  # checked, not asserted: ``python -O`` drops asserts
            raise VerificationError("<chunked digest>", f"'chunks' is a {type(chunks).__name__}, not a list")
        return cls(str(body["hash"]), int(str(body["chunk_bytes"])), int(str(body["size"])), tuple(map(str, chunks)))


def whole_digest(name: str, size: int, chunk_bytes: int, chunks: tuple[str, ...] | list[str]) -> str:
    h = new_hasher(name)
    h.update(b"rp-chunks-v2")
    h.update(size.to_bytes(8, "little") + chunk_bytes.to_bytes(8, "little"))
    for hexd in chunks:
        h.update(bytes.fromhex(hexd))
    return h.hexdigest()


def hash_bytes(name: str, data: bytes | memoryview) -> str:
    h = new_hasher(name)
    h.update(data)
    return h.hexdigest()


def _workers(threads: int) -> int:
    return max(1, min(threads, os.cpu_count() or 1))


# -- hashing a file that exists -------------------------------------------------------------------
# Every chunk is read in cache-sized blocks, hashed while they are still in the CPU's cache (a whole
# 16 MiB chunk read at once is not: 1.7x the raw read from the page cache, 4 MiB blocks ~1.1x), with
# a read-ahead thread keeping the next chunks requested from a cold disk (tiering/system/page_cache.py).
# Hashing a cached file in place through a mapping was measured and not kept: 0.061 s against
# 0.083 s per 2 GB when the pages came from writes, 0.17-0.25 s against 0.11 s when they came from
# the read-ahead's advice (small folios: a page fault per 64 KiB; README "Checkpoint I/O").
READ_BLOCK = 4 * 1024 * 1024
_BUFFERS = threading.local()


def _thread_buffer() -> memoryview:
    """This thread's reused read buffer (no allocation per chunk; memory stays at threads x READ_BLOCK)."""
    buf: bytearray | None = getattr(_BUFFERS, "buf", None)
    if buf is None:
        buf = _BUFFERS.buf = bytearray(READ_BLOCK)
    return memoryview(buf)


def _hash_chunk(fd: int, name: str, start: int, length: int) -> str:
    """Hash ``length`` bytes at ``start`` of ``fd`` in ``READ_BLOCK`` reads. ``pread`` and the hashes
    release the GIL, so reads and hashes of different chunks overlap across threads. A file that
    shrank while being read hashes short: no match."""
    h = new_hasher(name)
    view = _thread_buffer()
    pos = 0
    while pos < length:
        n = os.preadv(fd, [view[: min(READ_BLOCK, length - pos)]], start + pos)
        if n == 0:
            break
        h.update(view[:n])
        pos += n
    view.release()
    return h.hexdigest()


def _hash_chunks(fd: int, name: str, ranges: list[tuple[int, int]], threads: int) -> list[str]:
    """Digests of ``ranges`` (a file's chunks, in order), ``threads`` chunks at a time, the next
    chunks requested from the disk ahead of the readers when the file is not all cached."""
    workers = _workers(threads)
    with ReadAhead(fd, ranges, workers) as ahead:

        def one(rng: tuple[int, int]) -> str:
            try:
                return _hash_chunk(fd, name, *rng)
            finally:
                ahead.done()

        return hash_lanes(workers).map(one, ranges)


def hash_file(path: Path, spec: HashSpec = DEFAULT_HASHING) -> ChunkedDigest:
    """Chunked digest of an existing file, ``spec.threads`` chunks at a time."""
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        ranges = [chunk_range(i, size, spec.chunk_bytes) for i in range(chunk_count(size, spec.chunk_bytes))]
        chunks = tuple(_hash_chunks(fh.fileno(), spec.name, ranges, spec.threads))
    return ChunkedDigest(spec.name, spec.chunk_bytes, size, chunks)


def check_file(path: Path, expected: ChunkedDigest, threads: int = 2) -> None:
    """Read ``path`` once, ``threads`` chunks at a time, and compare every chunk with ``expected``;
    raises :class:`VerificationError` naming the first bad chunk (by offset) and its byte range."""
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size != expected.size:
            raise VerificationError(path, short_file_reason(size, expected))
        n = len(expected.chunks)
        ranges = [chunk_range(i, size, expected.chunk_bytes) for i in range(n)]
        got = _hash_chunks(fh.fileno(), expected.hash, ranges, threads)
    bad = [i for i in range(n) if got[i] != expected.chunks[i]]
    if bad:
        raise VerificationError(path, bad_chunk_reason(bad[0], n, size, expected.chunk_bytes))


def bad_chunk_reason(index: int, n: int, size: int, chunk_bytes: int) -> str:
    start, length = chunk_range(index, size, chunk_bytes)
    return f"chunk {index} of {n} (bytes {start}-{start + length - 1}) does not match manifest (corrupted bytes)"


def short_file_reason(size: int, expected: ChunkedDigest) -> str:
    n = len(expected.chunks)
    if size < expected.size:
        index = size // expected.chunk_bytes
        return f"size {size} != {expected.size} in manifest: truncated in chunk {index} of {n}"
    return f"size {size} != {expected.size} in manifest: extended past its last chunk ({n} chunks)"


# -- hashing bytes while they are written -----------------------------------------------------------
class ChunkHashingSink:
    """A write-only file that writes to ``raw`` while worker threads hash the same bytes by chunk.

    Chunk ``i``'s bytes all go to worker ``i % threads`` in order, so each chunk is hashed
    sequentially while different chunks are hashed in parallel; ``hashlib``/``blake3``/``xxhash``
    and ``write(2)`` release the GIL, so the digest costs no time beyond the write and the file is
    never read back. ``threads`` bounds the writer's extra CPU (the ranks need the cores). Large
    buffers (tensor storages handed over by ``torch.save``) are hashed in place; small ones are
    copied, since the caller may reuse them.
    """

    _COPY_BELOW = 1 << 20

    def __init__(self, raw: IO[bytes], name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = 1) -> None:
        self._raw = raw
        self._name = name
        self._chunk = chunk_bytes
        self._size = 0
        self._current: Hasher | None = None
        self._digests: dict[int, Hasher] = {}
        self._lanes = hash_lanes(_workers(threads))  # kept threads: see tiering.system.hash_threads

    def writable(self) -> bool:
        return True

    def _pieces(self, view: memoryview) -> Iterator[tuple[int, memoryview]]:
        """Split a write at chunk boundaries: ``(chunk index, piece)``."""
        offset, pos = self._size, 0
        while pos < view.nbytes:
            index = offset // self._chunk
            take = min(view.nbytes - pos, (index + 1) * self._chunk - offset)
            yield index, view[pos : pos + take]
            pos += take
            offset += take

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for index, piece in self._pieces(view):
            hasher = self._digests.get(index)
            if hasher is None:
                hasher = self._digests[index] = new_hasher(self._name)
            block = bytes(piece) if piece.nbytes < self._COPY_BELOW else piece
            self._lanes.submit(index, hasher.update, block)
        written = 0
        while written < view.nbytes:
            written += self._raw.write(view[written:])
        self._size += written
        return written

    def flush(self) -> None:
        """Wait until every byte written so far is hashed: a large buffer is hashed in place, after
        ``write`` returned, so its owner may free or change it only once this returns."""
        self._lanes.drain(range(self._lanes.n))

    def finish(self) -> ChunkedDigest:
        """Wait for the hashers; the chunked digest of everything written."""
        self._lanes.drain(range(self._lanes.n))
        chunks = tuple(self._digests[i].hexdigest() for i in range(chunk_count(self._size, self._chunk)))
        return ChunkedDigest(self._name, self._chunk, self._size, chunks)


# -- checking chunks as their bytes become available -------------------------------------------------
ChunkFailure = tuple[str, str]  # (file, one-line reason naming the chunk)


class ChunkChecker:
    """Checks digest chunks on ``threads`` workers as soon as their bytes are in memory, while the
    caller reads or receives the next ones; :meth:`result` waits and returns the first failure.

    The caller keeps each chunk's bytes unchanged until its future is done (a reused buffer waits
    for it); hashing releases the GIL, so checks overlap the caller's reads and the wire.
    """

    def __init__(self, threads: int = 2) -> None:
        self._lanes = hash_lanes(_workers(threads))  # kept threads: see tiering.system.hash_threads
        self._futures: list[Future[ChunkFailure | None]] = []

    def check(self, rel: str, expected: ChunkedDigest, index: int, data: memoryview) -> Future[ChunkFailure | None]:
        fut = self._lanes.submit(len(self._futures), _check_chunk, rel, expected, index, data)
        self._futures.append(fut)
        return fut

    def check_span(
        self, rel: str, expected: ChunkedDigest, start: int, data: memoryview
    ) -> list[Future[ChunkFailure | None]]:
        """Check every chunk of a span that begins at chunk boundary ``start`` of the file."""
        first = start // expected.chunk_bytes
        futures = []
        for index in range(first, chunk_count(start + data.nbytes, expected.chunk_bytes)):
            lo, length = chunk_range(index, expected.size, expected.chunk_bytes)
            futures.append(self.check(rel, expected, index, data[lo - start : lo - start + length]))
        return futures

    def result(self) -> ChunkFailure | None:
        """The first failure, once every check ran (the caller may reuse the buffers then; a check
        that raised is raised only after the others ended)."""
        wait(self._futures)
        results = [fut.result() for fut in self._futures]
        return next((bad for bad in results if bad is not None), None)


def _check_chunk(rel: str, expected: ChunkedDigest, index: int, data: memoryview) -> ChunkFailure | None:
    if hash_bytes(expected.hash, data) == expected.chunks[index]:
        return None
    return rel, bad_chunk_reason(index, len(expected.chunks), expected.size, expected.chunk_bytes)
