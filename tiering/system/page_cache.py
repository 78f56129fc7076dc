"""What the kernel's page cache holds of a file, and asking it to fetch what readers need next.

A verifier (``tiering.digest``) reads every file in cache-sized 4 MiB blocks. From a cold disk
small reads alone wait for the kernel's read-ahead window, so :class:`ReadAhead` keeps the next
chunks requested from a thread of its own
(``posix_fadvise(WILLNEED)``: the kernel allocates the pages and starts fetching them; one call
fetches at most the device's window, so the advice goes out in pieces of it): pages are allocated
and fetched while the readers hash. Measured on the CI VM (2 GB, 2 readers, README "Checkpoint
I/O"), that pattern was among the fastest raw reads both right after an eviction and once the host
had taken the freed memory back, where one 16 MiB request per chunk, the pattern chosen before,
swung from fastest to slowest. Whether pages are cached is asked with ``cachestat(2)`` (Linux 6.5),
which only counts pages (a probe that reads, ``preadv2(RWF_NOWAIT)``, starts read-ahead of its own
on a miss: 0.15 s per 2 GB). Where the kernel lacks it the answer is "unknown", which callers treat
as cold.
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
SYS_BDI = Path("/sys/class/bdi")
KERNEL_DEFAULT_WINDOW = 128 * 1024  # read_ahead_kb when neither the bdi nor a queue can be read


def _kb(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=64)
def advice_bytes(device: int, sys_block: Path = SYS_DEV_BLOCK, sys_bdi: Path = SYS_BDI) -> int:
    """The most one ``WILLNEED`` call on a file of ``device`` fetches: the kernel caps each call at
    the larger of the backing device's read-ahead window and its largest request
    (``force_page_cache_ra``; measured here: a 16 MiB advice fetched 8 MiB, ``read_ahead_kb``
    8192). The window is the device's bdi (whole disks, NFS, FUSE); a partition has none of its own
    and uses its disk's queue; the kernel's default where neither can be read (btrfs, overlayfs)."""
    name = f"{os.major(device)}:{os.minor(device)}"
    node = sys_block / name
    for window, largest in (
        (sys_bdi / name / "read_ahead_kb", node / "queue" / "max_sectors_kb"),
        (node / "queue" / "read_ahead_kb", node / "queue" / "max_sectors_kb"),
        (node / ".." / "queue" / "read_ahead_kb", node / ".." / "queue" / "max_sectors_kb"),
    ):
        kb = _kb(window)
        if kb is not None:
            return max(kb, _kb(largest) or 0, 4) * 1024
    return KERNEL_DEFAULT_WINDOW


READ_AHEAD_CHUNKS = 2  # chunks requested beyond those being read: 32 MiB of 16 MiB chunks (README)


class ReadAhead:
    """While open, a thread asks the kernel for the chunks ``ranges`` of ``fd`` (consecutive, in
    the order they are handed to ``readers`` readers), at most ``readers + depth`` beyond those the
    readers reported :meth:`done`: the chunks being read and ``depth`` more. Chunks already cached
    are skipped; a file wholly in the page cache, or a system without ``posix_fadvise``, starts no
    thread. Advice only: a reader that outruns it reads as it would without it, and its errors are
    ignored (an advisory call on a file that is being truncated says nothing about the bytes read)."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]], readers: int, depth: int = READ_AHEAD_CHUNKS) -> None:
        self._fd, self._ranges = fd, ranges
        self._budget = threading.Semaphore(max(0, readers) + depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._piece = advice_bytes(os.fstat(fd).st_dev)

    def __enter__(self) -> ReadAhead:
        total = sum(length for _, length in self._ranges)
        if self._ranges and hasattr(os, "posix_fadvise") and not is_cached(self._fd, self._ranges[0][0], total):
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
