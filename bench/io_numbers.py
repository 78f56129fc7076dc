"""Tier 1-2 checkpoint I/O against raw baselines of the same bytes, in the same layout, alternating.

* publish: the tier-1 save path (the writer's own ``save_state`` into the step's temporary
  directory with the chunked digest computed while writing, fsync, manifest, COMMITTED, rename,
  latest.json) / a raw durable write of the same serialized bytes (one file in a temporary
  directory, fsync, directory fsync, rename): a throughput ratio, each run after both paths' last
  outputs are removed, ``os.sync`` (no run pays for the writeback of the one before) and the wait
  of :mod:`bench.memory_state` (every run lands in memory left idle);
* restore: verify every chunk (all cores) + ``torch.load`` of the verified file (mapped) / a raw read
  of the same bytes on as many threads (16 MiB reads; 4 MiB reads; cold, 4 MiB reads with each
  thread's next chunk advised, and 4 MiB reads with the verifier's read-ahead thread, its I/O
  without the hash; all in every repeat; the baseline is the pattern with the lowest median), with
  the page cache evicted (``posix_fadvise(DONTNEED)``, what a restarted node reads; every cold
  read, the product's and each raw pattern's, after the wait of :mod:`bench.memory_state`, as it
  fills new page-cache pages) and warm;
* peak restore memory: RSS growth of a fresh process that restores the state into preallocated
  tensors (the model exists before a restore) / the state's size;
* peer restore: 2 gloo ranks on loopback; rank 1's disk is empty, rank 0 holds its replica: the
  tier 1-2 recovery (plan, verify while reading, stream, check chunks on arrival and write them
  into the new file, publish, load) / rank 0 reading the same bytes in the same pieces and sending
  each while it reads the next, rank 1 receiving them and writing every piece into a new file (the
  restore's landing, nothing checked: what the unverified ranged GETs are to an S3 restore); and a second
  pair against the wire alone (rank 1 receiving into memory that exists, ``wire``). Before every
  run the replica leaves rank 0's page cache, the copy the run before left is removed and the
  bench waits as :mod:`bench.memory_state` says.

``python -m bench.io_numbers --sizes-mb 300 2000 --repeats 5`` prints JSON (``make bench`` runs it).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.memory_state import ReclaimedStart, tree_bytes
from bench.pairs import alternate
from pretrain.checkpointing.async_writer import save_state
from pretrain.checkpointing.rank_payload import load_verified_state
from tiering.collective import SingleProcess, TorchCollective
from tiering.digest import DEFAULT_CHUNK_BYTES, LOCAL_HASH, READ_BLOCK, HashSpec, chunk_count, chunk_range
from tiering.layout import RunLayout
from tiering.local.posix import primary_store, replica_store
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.peer.restore import PeerRecovery
from tiering.peer.transport import PIECE, SEND_SLOTS, Transport
from tiering.system.fsio import fsync_dir, write_file_durably
from tiering.system.page_cache import ReadAhead, cached_bytes, evict
from tiering.trust.run_key import RunKey
from tiering.verify import VERIFY_THREADS, verify_step

STATE = "state.pt"
TOPOLOGY = {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}

BENCH_KEY = RunKey(b"bench-run-key-" * 3)  # the same on every rank: benches measure, they guard nothing


def make_state(mb: int) -> dict[str, Any]:
    """A tier-1-like state: a few large tensors and some small ones."""
    n = mb * 1024 * 1024 // 4
    return {"model": {"w": torch.randn(n // 3), "b": torch.randn(1000)}, "optimizer": {"m": torch.randn(n - n // 3)}}


def serialized(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def raw_durable_write(root: Path, name: str, data: bytes) -> float:
    """The limit of a durable publish: the same bytes, one file in a fresh directory, fsync, rename."""
    t0 = time.perf_counter()
    tmp = root / f"{name}.tmp"
    tmp.mkdir(parents=True)
    view = memoryview(data)
    with open(tmp / STATE, "xb", buffering=0) as fh:
        for start in range(0, len(view), 256 * 1024 * 1024):
            fh.write(view[start : start + 256 * 1024 * 1024])
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    os.rename(tmp, root / name)
    fsync_dir(root)
    return time.perf_counter() - t0


NO_ADVICE, NEXT_CHUNK, READ_AHEAD = "", " + next chunk advised", " + read-ahead thread"


def raw_patterns(cold: bool) -> list[tuple[int, str]]:
    """The raw ways to read a file (block size, advice): 16 MiB reads (one request per chunk),
    4 MiB reads (cache-sized) and, cold, 4 MiB reads with each thread's next chunk advised before
    it reads a chunk or with :class:`tiering.system.page_cache.ReadAhead` (what the verifier does)."""
    plain = [(DEFAULT_CHUNK_BYTES, NO_ADVICE), (READ_BLOCK, NO_ADVICE)]
    return plain + ([(READ_BLOCK, NEXT_CHUNK), (READ_BLOCK, READ_AHEAD)] if cold else [])


class RawRead:
    """The limit of reading a file into memory on ``threads`` threads: every raw pattern is run in
    each repeat (each after its own eviction when ``cold``), and the baseline is the pattern with
    the lowest median over the repeats. The per-repeat minimum over patterns would be biased low on
    a noisy machine (the luckiest of k draws against the product's one draw)."""

    def __init__(
        self, path: Path, cold: bool, threads: int = VERIFY_THREADS, settle: Callable[[], object] | None = None
    ) -> None:
        self.path, self.cold, self.threads = path, cold, threads
        # Cold: run before each pattern (the pattern before it cached the file); default: evict it.
        self.settle = settle or (lambda: evict(path))
        self.times: dict[str, list[float]] = {}

    def __call__(self, rep: int) -> float:
        now = {}
        for block, advice in raw_patterns(self.cold):
            if self.cold:
                self.settle()
            now[f"{block >> 20} MiB reads{advice}"] = _read_blocks(self.path, self.threads, block, advice)
        if rep >= 0:  # not the warm-up round
            for name, seconds in now.items():
                self.times.setdefault(name, []).append(seconds)
        return min(now.values())  # for alternate(); the pair's raw times are replaced by best()

    def best(self) -> tuple[str, list[float]]:
        """The pattern with the lowest median, and its seconds per repeat."""
        name = min(self.times, key=lambda n: statistics.median(self.times[n]))
        return name, self.times[name]


def _restore_pair(
    measured: Any, raw: RawRead, repeats: int, settle: Callable[[], object] = lambda: None
) -> dict[str, Any]:
    pair = alternate(measured, raw, repeats, settle=settle)
    pattern, pair.raw = raw.best()
    return {**pair.summary("time"), "raw_pattern": pattern}


def _read_blocks(path: Path, threads: int, block: int, advice: str, chunk: int = DEFAULT_CHUNK_BYTES) -> float:
    """``threads`` threads read the file's chunks in order, each in ``block``-sized reads, as the
    verifier hands them out (``advice``: see :func:`raw_patterns`)."""
    size = path.stat().st_size
    ranges = [chunk_range(i, size, chunk) for i in range(chunk_count(size, chunk))]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        buffers = threading.local()
        plan = ranges if advice == READ_AHEAD else []
        with ReadAhead(fd, plan, threads) as ahead, ThreadPoolExecutor(threads) as pool:

            def read(rng: tuple[int, int]) -> None:
                buf = getattr(buffers, "buf", None) or memoryview(bytearray(block))
                buffers.buf = buf
                start, length = rng
                if advice == NEXT_CHUNK:
                    os.posix_fadvise(fd, start + threads * chunk, chunk, os.POSIX_FADV_WILLNEED)
                try:
                    for pos in range(start, start + length, block):
                        os.preadv(fd, [buf], pos)
                finally:
                    ahead.done()

            list(pool.map(read, ranges))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def tier_publish(
    layout: RunLayout, step: int, state: dict[str, Any], spec: HashSpec, run: str = "bench", owner: int = 0
) -> float:
    t0 = time.perf_counter()
    pub = PosixStepPublisher(layout, SingleProcess(), f"b{step}", spec)
    tmp = pub.begin(step)
    digest = write_file_durably(tmp / STATE, lambda fh: save_state(state, fh), spec)
    manifest = manifest_for(run, step, 2, {"tp": 1, "pp": 1, "dp": 2}, extra={"owner_rank": owner})
    pub.commit(tmp, manifest, known={STATE: digest})
    return time.perf_counter() - t0


def tier_restore(step_dir: Path) -> float:
    """What a tier-1 restore does before ``load_state_dict``: verify every chunk, load the verified file."""
    t0 = time.perf_counter()
    verify_step(step_dir)
    load_verified_state(step_dir / STATE)
    return time.perf_counter() - t0


def measure_local(mb: int, repeats: int, work: Path, spec: HashSpec) -> dict[str, Any]:
    state = make_state(mb)
    data = serialized(state)
    layout = RunLayout(work / "tier", "bench")
    raw_root = work / "raw"
    raw_root.mkdir(parents=True)
    steps = iter(range(1, 10_000))

    def publish(rep: int) -> float:
        return tier_publish(layout, next(steps), state, spec)

    def write_raw(rep: int) -> float:
        return raw_durable_write(raw_root, "raw", data)

    def clear() -> int:
        """Both paths' last outputs, removed before every run (each lands in memory left idle)."""
        freed = tree_bytes([layout.steps_dir, raw_root / "raw"])
        shutil.rmtree(layout.steps_dir, ignore_errors=True)
        shutil.rmtree(raw_root / "raw", ignore_errors=True)
        return freed

    out: dict[str, Any] = {"size_mb": round(len(data) / 1e6), "hash": spec.name, "chunk_mb": spec.chunk_bytes >> 20}
    start = ReclaimedStart(clear)
    out["publish"] = alternate(publish, write_raw, repeats, settle=start).summary("throughput")
    out["publish"]["reclaim_wait_s"] = round(start.waited_s, 1)
    if not (raw_root / "raw" / STATE).exists():
        write_raw(-1)  # the restore pairs read both outputs; the last run left only its own
    if not layout.steps_dir.is_dir():
        publish(-1)
    step_dir = next(p for p in layout.steps_dir.iterdir() if p.name.startswith("step-"))
    raw_file = raw_root / "raw" / STATE

    def restore_cold(rep: int) -> float:
        return tier_restore(step_dir)  # the settle step (cold_start) evicted the step: an empty page cache

    # A cold read fills new page-cache pages: every read, the product's and each raw pattern's,
    # starts from memory the host can have taken back (bench.memory_state).
    cold_start = ReclaimedStart(lambda: sum(evict_counted(p) for p in [*step_dir.iterdir(), raw_file]))
    raw_start = ReclaimedStart(lambda: evict_counted(raw_file), cold_start.reporting)
    raw_cold = RawRead(raw_file, cold=True, settle=raw_start)
    out["restore_cold"] = _restore_pair(restore_cold, raw_cold, repeats, settle=cold_start)
    out["restore_cold"]["reclaim_wait_s"] = round(cold_start.waited_s + raw_start.waited_s, 1)
    out["restore_warm"] = _restore_pair(lambda r: tier_restore(step_dir), RawRead(raw_file, cold=False), repeats)
    out["restore_rss"] = restore_rss(step_dir, len(data))
    return out


_RSS_PROBE = """
import json, sys, torch
from pathlib import Path
from bench.io_numbers import STATE
from pretrain.checkpointing.async_writer import save_state
from pretrain.checkpointing.rank_payload import load_verified_state
from tiering.verify import verify_step
step_dir = Path(sys.argv[1])
shapes = {k: v for k, v in torch.load(step_dir / STATE, weights_only=True, mmap=True).items()}
model = {g: {k: torch.empty_like(t) for k, t in d.items()} for g, d in shapes.items()}
for d in model.values():
    for t in d.values():
        t.zero_()  # the model's memory exists before the restore
del shapes
def status_bytes(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1]) * 1024
before = status_bytes("VmRSS")
verify_step(step_dir)
loaded = load_verified_state(step_dir / STATE)
for g, d in loaded.items():
    for k, t in d.items():
        model[g][k].copy_(t)
peak = status_bytes("VmHWM")  # ru_maxrss would count the parent: exec keeps the old mm's high-water mark
print(json.dumps({"before": before, "peak": peak}))
"""


def restore_rss(step_dir: Path, nbytes: int) -> dict[str, Any]:
    """Peak RSS growth of a fresh process restoring into a preallocated model, over the state size."""
    for p in step_dir.iterdir():
        evict(p)
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(step_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "state_bytes": nbytes,
        "growth_bytes": row["peak"] - row["before"],
        "ratio": round((row["peak"] - row["before"]) / nbytes, 3),
    }


class _PeerBench:
    """One rank of the peer-restore pair. Rank 1's node is empty; node 0 holds rank 1's replica
    (and a small primary of rank 0, so that what is timed is the peer path alone)."""

    def __init__(self, rank: int, root: Path, mb: int) -> None:
        self.rank, self.root = rank, root
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
        self.coll = TorchCollective()
        self.transport = Transport(self.group, 600, key=BENCH_KEY)
        self.node_root = root / f"node-{rank}"
        self.replica = replica_store(root / "node-0", 1, "run", 3).step_path(10)
        if rank == 0:
            spec = HashSpec(LOCAL_HASH, DEFAULT_CHUNK_BYTES, 2)
            tier_publish(replica_store(self.node_root, 1, "run", 3).layout, 10, make_state(mb), spec, "run", owner=1)
            tier_publish(primary_store(self.node_root, 0, "run", 3).layout, 10, make_state(1), spec, "run", owner=0)
        self.coll.barrier()
        size = torch.tensor([os.path.getsize(self.replica / STATE) if rank == 0 else 0])
        dist.broadcast(size, 0, group=self.group)
        self.size = int(size.item())
        # The raw paths' memory exists (and is touched) before they are timed: the limit, not page
        # faults. Rank 0 sends from these pieces; rank 1 lands the landed path's pieces in them.
        self.pieces = [torch.zeros(PIECE, dtype=torch.uint8) for _ in range(SEND_SLOTS)]
        self.landing = torch.zeros(self.size, dtype=torch.uint8) if rank == 1 else torch.empty(0)
        self.kept = root / "raw-landed"

    def clear(self) -> int:
        """Collective. Drop the replica from rank 0's page cache and remove the copy the run
        before left on rank 1; the bytes freed on the machine (both ranks share its memory)."""
        freed = 0
        if self.rank == 0:
            freed += evict_counted(self.replica / STATE)
        else:
            freed += tree_bytes([self.root / "node-1", self.kept])
            shutil.rmtree(self.root / "node-1", ignore_errors=True)
            shutil.rmtree(self.kept, ignore_errors=True)
        return sum(self.coll.all_gather(freed))

    def _timed(self, body: Any) -> float:
        self.coll.barrier()  # the pair's settle step (clear) has emptied rank 1's node and rank 0's cache
        t0 = time.perf_counter()
        body()
        seconds = time.perf_counter() - t0
        self.coll.barrier()
        return seconds

    def restore(self, rep: int) -> float:
        def body() -> None:
            node, where = f"node-{self.rank}", self.node_root
            rec = PeerRecovery("run", self.rank, 2, node, where, self.coll, self.transport, TOPOLOGY, 3, f"p{rep}")
            got = rec.recover().restore
            assert got is not None and got.step == 10, got
            load_verified_state(got.path / STATE)

        return self._timed(body)

    def raw(self, rep: int, landed: bool = False) -> float:
        """The raw path; ``landed``: rank 1 also writes every piece into a new file, as the
        restore keeps its copy (the target's baseline); else the wire alone."""

        def body() -> None:
            if self.rank == 0:
                raw_send(self.replica / STATE, self.group, self.pieces)
            elif landed:
                self.kept.mkdir()
                raw_receive_into_file(self.kept / STATE, self.size, self.group, self.pieces)
            else:
                raw_receive(self.landing, self.group)

        return self._timed(body)


def _peer_worker(rank: int, root: str, mb: int, repeats: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    bench = _PeerBench(rank, Path(root), mb)
    start = ReclaimedStart(bench.clear)
    landed = alternate(bench.restore, lambda rep: bench.raw(rep, landed=True), repeats, settle=start)
    landed_wait, start.waited_s = start.waited_s, 0.0
    wire = alternate(bench.restore, bench.raw, repeats, settle=start)
    row = {**landed.summary("time"), "reclaim_wait_s": round(landed_wait, 1)}
    row["wire"] = {**wire.summary("time"), "reclaim_wait_s": round(start.waited_s, 1)}
    row["free_page_reporting"] = start.reporting
    rows = bench.coll.all_gather(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows[1]))  # what the restoring rank (1) saw
    dist.destroy_process_group()


def evict_counted(path: Path) -> int:
    """Drop ``path`` from the page cache; the bytes it had there (its size where the kernel
    cannot say)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        cached = cached_bytes(fd, 0, size)
    finally:
        os.close(fd)
    evict(path)
    return size if cached is None else cached


def raw_send(path: Path, group: Any, slots: list[torch.Tensor]) -> None:
    """The limit of serving a copy: read it in pieces and send each while the next is read
    (as many pieces in flight as the transport, in buffers that already exist), nothing checked."""
    works: list[Any] = [None] * len(slots)
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as fh:
        for n, start in enumerate(range(0, size, PIECE)):
            slot = n % len(slots)
            if works[slot] is not None:
                works[slot].wait()
            buf = slots[slot][: min(PIECE, size - start)]
            os.preadv(fh.fileno(), [memoryview(buf.numpy())], start)
            works[slot] = dist.isend(buf, dst=1, group=group, tag=3 + n)
    for work in works:
        if work is not None:
            work.wait()


def raw_receive(data: torch.Tensor, group: Any) -> None:
    """The limit of fetching a copy: every piece received into memory that already exists (not
    written, not checked)."""
    size = data.numel()
    works = [
        dist.irecv(data.narrow(0, start, min(PIECE, size - start)), src=0, group=group, tag=3 + n)
        for n, start in enumerate(range(0, size, PIECE))
    ]
    for work in works:
        work.wait()


def raw_receive_into_file(path: Path, size: int, group: Any, slots: list[torch.Tensor]) -> None:
    """Receive the pieces into a few reused ``slots`` (memory that exists) and ``pwrite``
    each into a new file with its space reserved: the restore's landing, with nothing checked,
    planned or published. What it adds to :func:`raw_receive` is the cost of new page-cache
    pages (on this VM a host fault per page once the host has taken the memory back:
    :mod:`bench.memory_state`)."""
    pieces = list(range(0, size, PIECE))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)

        def post(n: int) -> Any:
            into = slots[n % SEND_SLOTS][: min(PIECE, size - pieces[n])]
            return dist.irecv(into, src=0, group=group, tag=3 + n)

        works = {n: post(n) for n in range(min(SEND_SLOTS, len(pieces)))}
        for n, start in enumerate(pieces):
            works.pop(n).wait()
            view = memoryview(slots[n % SEND_SLOTS][: min(PIECE, size - start)].numpy())
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], start + done)
            if n + SEND_SLOTS < len(pieces):
                works[n + SEND_SLOTS] = post(n + SEND_SLOTS)
    finally:
        os.close(fd)


def measure_peer(mb: int, repeats: int, work: Path) -> dict[str, Any]:
    out = work / "peer.json"
    port = 29500 + os.getpid() % 1000
    mp.spawn(_peer_worker, args=(str(work), mb, repeats, port, str(out)), nprocs=2, join=True)
    return {"size_mb": mb, "peer_restore": json.loads(out.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[DEFAULT_CHUNK_BYTES >> 20])
    parser.add_argument("--hash", default=LOCAL_HASH)
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        for mb in args.sizes_mb:
            for chunk_mb in args.chunk_mb:
                work = Path(td) / f"{mb}-{chunk_mb}"
                spec = HashSpec(args.hash, chunk_mb << 20, 2)
                rows.append(measure_local(mb, args.repeats, work, spec))
                shutil.rmtree(work)
            if not args.no_peer:
                rows[-1].update(measure_peer(mb, args.repeats, Path(td) / f"peer-{mb}"))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
