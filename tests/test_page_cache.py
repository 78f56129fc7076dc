"""The verifier's read-ahead: how far ahead of its readers it asks the kernel for a cold file's
chunks (real files, real page cache, ``cachestat`` counting what was fetched), that closing it
wakes a thread waiting for budget, and where the size of one advice call is read from (a
sysfs-shaped tree of real files and symlinks)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tiering.system.page_cache import KERNEL_DEFAULT_WINDOW, ReadAhead, advice_bytes, cached_bytes, evict

CHUNK = 4 * 1024 * 1024 + 4097  # not page-aligned: neighbouring chunks share a page


def _cold_file(path: Path, chunks: int) -> list[tuple[int, int]]:
    path.write_bytes(random.Random(3).randbytes(chunks * CHUNK))
    evict(path)
    return [(i * CHUNK, CHUNK) for i in range(chunks)]


def _until(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_read_ahead_keeps_the_chunks_being_read_and_depth_more_requested(tmp_path: Path) -> None:
    path = tmp_path / "cold.bin"
    ranges = _cold_file(path, 5)
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_bytes(fd, 0, 1) is None:
            pytest.skip("this kernel has no cachestat(2): what the read-ahead fetched cannot be counted")

        def cached(index: int) -> int:
            return cached_bytes(fd, index * CHUNK, CHUNK) or 0

        with ReadAhead(fd, ranges, readers=2, depth=1) as ahead:
            assert _until(lambda: all(cached(i) == CHUNK for i in range(3))), "the 3 chunks of its budget"
            time.sleep(0.3)  # time to run past its budget, were it going to
            assert cached(3) < CHUNK, "requested a 4th chunk before a reader finished one"
            ahead.done()
            assert _until(lambda: cached(3) == CHUNK), "a finished chunk did not let one more be requested"
            time.sleep(0.3)
            assert cached(4) < CHUNK, "one finished chunk let more than one more be requested"
    finally:
        os.close(fd)


def test_closing_the_read_ahead_stops_a_thread_waiting_for_budget(tmp_path: Path) -> None:
    path = tmp_path / "cold.bin"
    ranges = _cold_file(path, 4)
    fd = os.open(path, os.O_RDONLY)
    closed = threading.Event()

    def open_and_close() -> None:
        with ReadAhead(fd, ranges, readers=0, depth=1):
            time.sleep(0.2)  # the thread has used its budget and waits
        closed.set()

    try:
        worker = threading.Thread(target=open_and_close, daemon=True)
        worker.start()
        worker.join(10)
        assert closed.is_set(), "closing the read-ahead hung on its thread"
    finally:
        os.close(fd)


def test_one_advice_is_as_large_as_the_window_of_the_device_that_backs_the_file(tmp_path: Path) -> None:
    """The bdi's window (whole disks, NFS), a partition's disk's queue, the kernel's default."""
    block, bdi = tmp_path / "dev" / "block", tmp_path / "class" / "bdi"
    disk = tmp_path / "devices" / "vda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text("8192\n")
    (disk / "queue" / "max_sectors_kb").write_text("16384\n")
    (disk / "vda1").mkdir()
    block.mkdir(parents=True)
    (block / "254:0").symlink_to(disk)
    (block / "254:1").symlink_to(disk / "vda1")
    (bdi / "254:0").mkdir(parents=True)
    (bdi / "254:0" / "read_ahead_kb").write_text("4096\n")
    (bdi / "0:53").mkdir()
    (bdi / "0:53" / "read_ahead_kb").write_text("15360\n")
    assert advice_bytes(os.makedev(254, 0), block, bdi) == 16384 * 1024, "the larger of window and request"
    assert advice_bytes(os.makedev(254, 1), block, bdi) == 16384 * 1024, "a partition: its disk's queue"
    assert advice_bytes(os.makedev(0, 53), block, bdi) == 15360 * 1024, "NFS: its bdi alone"
    assert advice_bytes(os.makedev(0, 40), block, bdi) == KERNEL_DEFAULT_WINDOW, "nothing to read"
