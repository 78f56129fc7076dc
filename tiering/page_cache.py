"""What the kernel's page cache holds of a file, and asking it to fetch what a reader needs next.

A verifier reads every chunk in cache-sized 4 MiB blocks, hashed while they are still in the CPU's
cache (16 MiB reads took 1.7x the raw read from the page cache). On a cold disk small reads alone
wait for the kernel's read-ahead window, so :class:`ReadAhead` keeps the next chunks requested
(``posix_fadvise(WILLNEED)``: the kernel allocates their pages and starts one large fetch each)
from a thread of its own, a few chunks ahead of the readers: pages are allocated and fetched while
the readers hash. Measured on the CI VM (2 GB, 2 readers, README "Checkpoint I/O"), that pattern
was the fastest raw read both right after an eviction and once the host had taken the freed memory
back, where one 16 MiB request per chunk, the pattern this module chose before, swung from fastest
to slowest. Whether pages are cached is asked with ``cachestat(2)`` (Linux 6.5), which only counts
pages (a probe that reads, ``preadv2(RWF_NOWAIT)``, starts read-ahead of its own on a miss: 0.15 s
per 2 GB). Where the kernel lacks it the answer is "unknown", which callers treat as cold.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import threading
from pathlib import Path
from types import TracebackType

# cachestat is 451 in the generic system-call table, which x86-64 and arm64 share for it.
_CACHESTAT = 451 if platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Counts(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_libc = ctypes.CDLL(None, use_errno=True) if _CACHESTAT is not None else None
_supported = _libc is not None


def cached_bytes(fd: int, start: int, length: int) -> int | None:
    """Bytes of ``[start, start + length)`` of ``fd`` in the page cache (page granular), or None
    when this kernel cannot say (no ``cachestat``: Linux < 6.5, another OS, a seccomp filter)."""
    global _supported
    if not _supported or _libc is None:
        return None
    if length <= 0:
        return 0
    rng, counts = _Range(start, length), _Counts()
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(counts), 0) == 0:
        return min(length, counts.nr_cache * _PAGE)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        _supported = False  # asked once per process: the kernel does not change under us
    return None


def is_cached(fd: int, start: int, length: int) -> bool:
    """Every page of the range is cached (False when unknown)."""
    have = cached_bytes(fd, start, length)
    return have is not None and have >= length


def evict(path: Path) -> None:
    """Write ``path``'s dirty pages and drop the file from the page cache: what a restarted node
    reads (benchmarks and tests of the cold read path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


SYS_DEV_BLOCK = Path("/sys/dev/block")
KERNEL_DEFAULT_WINDOW = 128 * 1024  # read_ahead_kb when a device's queue cannot be read


@functools.lru_cache(maxsize=64)
def advice_bytes(device: int, sys_block: Path = SYS_DEV_BLOCK) -> int:
    """The most one ``WILLNEED`` call on a file of ``device`` fetches: the kernel caps each call at
    the device's read-ahead window or its largest request, whichever is larger (``force_page_cache_ra``;
    measured here: a 16 MiB advice fetched 8 MiB, ``read_ahead_kb`` 8192). Read from the queue of
    the disk (a partition's parent); the kernel's default window where there is none (network and
    virtual file systems)."""
    node = sys_block / f"{os.major(device)}:{os.minor(device)}"
    for queue in (node / "queue", node / ".." / "queue"):
        try:
            kb = [int((queue / name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(max(kb) * 1024, 4096)
    return KERNEL_DEFAULT_WINDOW


READ_AHEAD_CHUNKS = 4  # chunks requested ahead of the readers: 64 MiB of 16 MiB chunks (measured, README)


class ReadAhead:
    """While open, a thread asks the kernel for the chunks ``ranges`` of ``fd`` in order, at most
    ``depth`` beyond those the readers reported :meth:`done` (chunks are handed to readers in the
    same order), skipping chunks already cached. A file wholly in the page cache starts no thread.
    Advice only: a reader that outruns it reads as it would without it, and its errors are ignored
    (an advisory call on a file that is being truncated says nothing about the bytes read)."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]], depth: int = READ_AHEAD_CHUNKS) -> None:
        self._fd, self._ranges = fd, ranges
        self._budget = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._piece = advice_bytes(os.fstat(fd).st_dev)

    def __enter__(self) -> ReadAhead:
        total = sum(length for _, length in self._ranges)
        if self._ranges and not is_cached(self._fd, self._ranges[0][0], total):
            self._thread = threading.Thread(target=self._advise, name="read-ahead", daemon=True)
            self._thread.start()
        return self

    def done(self) -> None:
        """A reader finished a chunk: the thread may request one more."""
        self._budget.release()

    def _advise(self) -> None:
        for start, length in self._ranges:
            self._budget.acquire()
            if self._stop.is_set():
                return
            if not is_cached(self._fd, start, length):
                try:
                    for at in range(start, start + length, self._piece):
                        os.posix_fadvise(self._fd, at, min(self._piece, start + length - at), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._budget.release()  # wakes a thread waiting for budget so that it sees the stop
        if self._thread is not None:
            self._thread.join()
