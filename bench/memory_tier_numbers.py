"""Tier 0 against raw baselines of the same bytes on the same tmpfs, alternating (:mod:`bench.pairs`).

* restore: the tier-0 restore of one rank's slot (verify every chunk on all cores against the slot's
  header, then ``torch.load(mmap=True)`` of the verified file) / a raw read of the same file on as
  many threads in the verifier's 4 MiB blocks (the bytes in memory, nothing checked): target <= 1.5x;
* snapshot: the tier-0 write of one state (invalidate, serialise straight into the slot file in
  place, hash the file by chunks, seal) / a raw in-place write of the same serialised bytes into a
  tmpfs file (no header, no hash): reported (what a snapshot costs the writer thread).

``python -m bench.memory_tier_numbers --sizes-mb 300 --repeats 5`` prints JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.io_numbers import make_state
from bench.pairs import alternate
from pretrain.checkpointing.async_writer import save_state
from pretrain.checkpointing.per_rank import load_verified_state
from tiering.digest import READ_BLOCK, HashSpec
from tiering.manifest import Manifest
from tiering.slot_store import SlotStore
from tiering.verify import VERIFY_THREADS

HASHING = HashSpec(threads=2)  # checkpoint.integrity's defaults: xxh3-128, 16 MiB chunks, 2 threads


def _raw_read(path: Path, threads: int) -> float:
    """Read every byte of ``path`` on ``threads`` threads in READ_BLOCK pieces (into reused buffers)."""
    size = path.stat().st_size
    blocks = list(range(0, size, READ_BLOCK))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(worker: int) -> int:
            buf = bytearray(READ_BLOCK)
            view = memoryview(buf)
            got = 0
            for start in blocks[worker::threads]:
                got += os.preadv(fd, [view[: min(READ_BLOCK, size - start)]], start)
            return got

        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(threads)))
    finally:
        os.close(fd)
    assert total == size
    return time.perf_counter() - t0


def _restore(store: SlotStore) -> float:
    t0 = time.perf_counter()
    store.verify(0, VERIFY_THREADS)
    state = load_verified_state(store.state_path(0))
    elapsed = time.perf_counter() - t0
    del state
    return elapsed


def _snapshot(store: SlotStore, state: dict[str, Any], step: int) -> float:
    t0 = time.perf_counter()
    store.write_payload(1, lambda fh: save_state(state, fh), fresh_inode=False)
    manifest = Manifest("bench", step, 1, {"tp": 1, "pp": 1, "dp": 1}, [])
    store.seal(1, manifest, store.digest(1, HASHING), step + 10)
    return time.perf_counter() - t0


def _raw_write(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        view = memoryview(data)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], done)
        os.ftruncate(fd, done)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def measure(mb: int, repeats: int, root: Path) -> dict[str, Any]:
    state = make_state(mb)
    store = SlotStore(root, "bench", 0, 2)
    _snapshot(store, state, 0)
    os.replace(store.slot_dir(1), store.slot_dir(0))  # slot 0: the sealed slot the restore reads
    buf = io.BytesIO()
    save_state(state, buf)
    data = buf.getvalue()
    raw_path = root / "raw.pt"
    restore = alternate(lambda _: _restore(store), lambda _: _raw_read(store.state_path(0), VERIFY_THREADS), repeats)
    snapshot = alternate(lambda rep: _snapshot(store, state, rep + 2), lambda _: _raw_write(raw_path, data), repeats)
    return {
        "size_mb": mb,
        "bytes": len(data),
        "restore_vs_raw_read": {**restore.summary("time"), "target": "<= 1.5"},
        "snapshot_vs_raw_write": snapshot.summary("time"),
        "threads": VERIFY_THREADS,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs (the bench uses a fresh directory in it)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rp-bench-tier0-", dir=args.dir))
    try:
        rows = [measure(mb, args.repeats, root) for mb in args.sizes_mb]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    json.dump({"torch": torch.__version__, "cpus": os.cpu_count(), "tier0": rows}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
