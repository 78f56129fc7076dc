"""Tier 0 against raw baselines of the same bytes on the same tmpfs, alternating (:mod:`bench.pairs`).

* restore: the tier-0 restore of one rank's slot (verify every chunk on all cores against the slot's
  header, then the verified file mapped: :func:`pretrain.checkpointing.raw_payload.read`) / a raw
  read of the same file on as many threads in the verifier's 4 MiB blocks (the bytes in memory,
  nothing checked): target <= 1.5x;
* snapshot: the tier-0 write of one state (invalidate, write it in the raw layout straight into the
  slot file in place, hash the file by chunks, seal) / a raw in-place write of the same serialised
  bytes into a tmpfs file (no header, no hash): reported (what a snapshot costs the writer thread);
* peak memory: in a fresh process holding one state, ``slots + 1`` snapshots (every slot written,
  then the oldest rewritten); then, as a restarted rank, the state restored from the newest slot
  (mapped, then updated in place as the optimizer does) and ``slots`` more snapshots of it: the most
  anonymous memory the process gained (sampled every 2 ms) plus the tmpfs in use, over the state's
  size, at both points; target <= 2 x slots + 0.3. The tmpfs figure is the filesystem's used bytes,
  so a slot rewritten on a new inode while the old one is still mapped counts twice, as it does on
  the node: give ``--dir`` a tmpfs of its own for exact figures.

``python -m bench.memory_tier_numbers --sizes-mb 300 --repeats 5`` prints JSON.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.io_numbers import make_state
from bench.pairs import alternate
from pretrain.checkpointing import raw_payload
from pretrain.checkpointing.rank_payload import load_verified_state
from tiering.digest import READ_BLOCK, HashSpec
from tiering.manifest import Manifest
from tiering.memory.slot_store import SlotStore
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


def _snapshot(store: SlotStore, state: dict[str, Any], step: int, index: int = 1, fresh_inode: bool = False) -> float:
    """One tier-0 snapshot of ``state`` into slot ``index``, as tier 0 takes it: written in place
    (or on a new inode) and hashed while written, then sealed."""
    t0 = time.perf_counter()
    digest = store.write_hashed(index, functools.partial(raw_payload.write, state), fresh_inode, HASHING)
    manifest = Manifest("bench", step, 1, {"tp": 1, "pp": 1, "dp": 1}, [])
    store.seal(index, manifest, digest, step + 10)
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


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def _tmpfs_used(root: Path) -> int:
    """Bytes in use on the filesystem of ``root``: unlinked files a process still maps included."""
    st = os.statvfs(root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def peak_memory_probe(mb: int, slots: int, root: Path) -> dict[str, Any]:
    """Run in a fresh process (``--peak-probe``), ``root`` on a tmpfs of its own (its used bytes
    are read from the filesystem, so that a mapped, unlinked slot counts): see the module docstring."""
    state = make_state(mb)
    state_bytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    base, used0, peak, done = _rss_anon(), _tmpfs_used(root), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss_anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    store = SlotStore(root, "bench", 0, slots)
    for step in range(slots + 1):  # every slot written, then the oldest rewritten
        _snapshot(store, state, step, step % slots)
    steady = {"anon_growth_bytes": max(peak[0], _rss_anon()) - base, "tmpfs_bytes": _tmpfs_used(root) - used0}
    # A restarted rank: the state restored from the newest slot (mapped) replaces its own, the
    # optimizer's in-place update turns the mapped pages it touches into private copies, and the next
    # snapshot into that slot goes to a new inode (the mapped one stays until the process drops it).
    newest = 0  # the last of those snapshots, step ``slots``, went into slot ``slots % slots``
    store.verify(newest, VERIFY_THREADS)
    del state
    restored = load_verified_state(store.state_path(newest))
    for part in restored.values():
        for tensor in part.values():
            tensor.add_(1.0)
    for step in range(slots + 1, 2 * slots + 1):
        _snapshot(store, restored, step, step % slots, fresh_inode=step % slots == newest)
    after = {"anon_growth_bytes": max(peak[0], _rss_anon()) - base, "tmpfs_bytes": _tmpfs_used(root) - used0}
    done.set()
    sampler.join()

    def ratio(row: dict[str, int]) -> float:
        return round((row["anon_growth_bytes"] + row["tmpfs_bytes"]) / state_bytes, 3)

    return {
        "slots": slots,
        "state_bytes": state_bytes,
        "steady": {**steady, "ratio": ratio(steady)},
        "after_a_tier0_restore": {**after, "ratio": ratio(after)},
        "target": f"<= {2 * slots + 0.3}",
    }


def peak_memory(mb: int, slots: int, root: Path) -> dict[str, Any]:
    probe = root / "peak"
    probe.mkdir(exist_ok=True)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.memory_tier_numbers", "--peak-probe", str(mb), str(slots), str(probe)],
            check=True, capture_output=True, text=True, timeout=600,
        ).stdout  # fmt: skip
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return json.loads(out)


def measure(mb: int, repeats: int, root: Path) -> dict[str, Any]:
    state = make_state(mb)
    store = SlotStore(root, "bench", 0, 2)
    _snapshot(store, state, 0)
    os.replace(store.slot_dir(1), store.slot_dir(0))  # slot 0: the sealed slot the restore reads
    buf = io.BytesIO()
    raw_payload.write(state, buf)
    data = buf.getvalue()
    raw_path = root / "raw.pt"
    restore = alternate(lambda _: _restore(store), lambda _: _raw_read(store.state_path(0), VERIFY_THREADS), repeats)
    snapshot = alternate(lambda rep: _snapshot(store, state, rep + 2), lambda _: _raw_write(raw_path, data), repeats)
    return {
        "size_mb": mb,
        "bytes": len(data),
        "restore_vs_raw_read": {**restore.summary("time"), "target": "<= 1.5"},
        "snapshot_vs_raw_write": snapshot.summary("time"),
        "peak_memory": peak_memory(mb, 2, root),
        "threads": VERIFY_THREADS,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs (the bench uses a fresh directory in it)")
    parser.add_argument("--peak-probe", nargs=3, metavar=("MB", "SLOTS", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_probe:
        mb, slots, where = args.peak_probe
        print(json.dumps(peak_memory_probe(int(mb), int(slots), Path(where))))
        return 0
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
