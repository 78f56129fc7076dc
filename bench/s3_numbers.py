"""Tier 3 throughput on a real S3 server, each as a ratio to raw boto3 on the same bytes in the same run:

* promotion (``RemoteTier.upload_step``: objects, the local step verified while they upload, size
  checks, manifest, COMMITTED, latest.json) / ``upload_file`` of the same files;
* restore (one ranged GET per digest chunk, in parallel, each hashed and written piece by piece as
  it arrives, then the local publish) / the same ranged GETs landed raw: as many at a time, each
  body written at its offset into a new file as it arrives, not hashed (plain boto3
  ``get_object``). That is this request pattern's limit, and the faster of the two raw paths
  measured here: ``download_file`` of the same files, reported beside it, is beaten by the
  verified restore (README "Measured"), so it does not measure the limit. Every path uses the
  product's boto3 client (same connection pool, retries and checksum settings).

The paths of a pair alternate which runs first (``download_file`` takes each of the restore's
three places in turn), and each ratio is the median with the spread of the per-repeat ratios
(:mod:`bench.pairs`). Every restore run starts from the same memory state: what the run before
landed is removed and the bench waits until the host can have taken it back
(:mod:`bench.memory_state`).

Run: ``python -m bench.s3_numbers --endpoint-url http://127.0.0.1:7480 --sizes-mb 300 2000``
(AWS_* credentials from the environment; Ceph RGW test keys are testing/testing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig

from bench.memory_state import ReclaimedStart, tree_bytes
from bench.pairs import Pair
from tiering.collective import SingleProcess
from tiering.digest import DEFAULT_CHUNK_BYTES, PORTABLE_HASH, HashSpec, chunk_count, chunk_range
from tiering.layout import RunLayout
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.remote.objectstore import RANGE_PIECE_BYTES, S3Store, open_store
from tiering.remote.tier import RemoteTier


def make_step(root: Path, step: int, total_mb: int, shards: int = 4) -> Path:
    """A reshardable-like step (what S3 receives): ``shards`` files, blake3 chunk digests."""
    layout = RunLayout(root, "bench")
    pub = PosixStepPublisher(layout, SingleProcess(), f"a{step}", HashSpec(PORTABLE_HASH, DEFAULT_CHUNK_BYTES, 2))
    tmp = pub.begin(step)
    (tmp / "model").mkdir()
    per = total_mb * 1024 * 1024 // shards
    block = os.urandom(8 * 1024 * 1024)
    for i in range(shards):
        with open(tmp / "model" / f"__{i}_0.distcp", "wb") as fh:
            left = per
            while left:
                left -= fh.write(block[: min(left, len(block))])
    pub.commit(tmp, manifest_for("bench", step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    return layout.step_dir(step)


def measure(bucket: str, endpoint: str, size: int, repeats: int, concurrency: int, td: Path) -> dict:
    """Alternating pairs: promotion vs ``upload_file``; verified restore vs the same ranged GETs
    unverified, and vs ``download_file``."""
    transfer = TransferConfig(multipart_chunksize=64 * 1024 * 1024, max_concurrency=concurrency)
    store, prefix = open_store(f"s3://{bucket}/tier{size}", endpoint, concurrency)
    assert isinstance(store, S3Store)
    remote = RemoteTier(store, prefix, "bench", concurrency)
    landed = [td / f"{name}{size}" for name in ("down", "back", "wire")]
    for path in landed:
        path.mkdir()

    def clear() -> int:
        freed = tree_bytes(landed)
        for path in landed:
            shutil.rmtree(path)
            path.mkdir()
        return freed

    case = _Case(store.client, bucket, remote, transfer, size, td, concurrency, landed, ReclaimedStart(clear))
    ups, downs, wire = Pair(), Pair(), Pair()
    for rep in range(repeats):
        _repeat(case, rep, ups, downs, wire)
        # Free the server (a memstore RGW holds objects in RAM) before the next repeat.
        store.delete([o.key for o in store.list(prefix)] + [o.key for o in store.list(f"raw/{size}/{rep}/")])
    restore = {**wire.summary("time"), "download_file": downs.summary("time")}
    return {"size_mb": round(size * 1.048576), "promotion": ups.summary("throughput"), "restore": restore}


@dataclass
class _Case:
    client: Any
    bucket: str
    remote: RemoteTier
    transfer: TransferConfig
    size: int
    td: Path
    concurrency: int
    landed: list[Path]  # where the restore's three paths land their copies: down, back, wire
    settle: ReclaimedStart  # before each restore run: remove what the last one landed, wait


def _wire_download(c: _Case, keys: list[str], sizes: list[int], into: Path) -> None:
    """The restore's requests without its verification: one ranged GET per chunk, ``concurrency``
    at a time, each body written at its offset into a new file as it arrives."""
    fds = [os.open(into / Path(k).name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644) for k in keys]
    for fd, size in zip(fds, sizes, strict=True):
        os.ftruncate(fd, size)

    def get(job: tuple[int, int]) -> None:
        which, index = job
        start, length = chunk_range(index, sizes[which], DEFAULT_CHUNK_BYTES)
        span = f"bytes={start}-{start + length - 1}"
        body = c.client.get_object(Bucket=c.bucket, Key=keys[which], Range=span)["Body"]
        for piece in body.iter_chunks(RANGE_PIECE_BYTES):
            os.pwrite(fds[which], piece, start)
            start += len(piece)

    jobs = [(w, i) for w, size in enumerate(sizes) for i in range(chunk_count(size, DEFAULT_CHUNK_BYTES))]
    try:
        with ThreadPoolExecutor(max_workers=c.concurrency) as pool:
            list(pool.map(get, jobs))
    finally:
        for fd in fds:
            os.close(fd)


def _repeat(c: _Case, rep: int, ups: Pair, downs: Pair, wire: Pair) -> None:
    """One repeat of every pair. The promotion's raw path goes first on even repeats, second on
    odd ones; so does the unverified ranged GETs' against the verified restore, with
    ``download_file`` before, between or after them in turn."""
    step = 10 * (rep + 1)
    step_dir = make_step(c.td / f"s{c.size}", step, c.size)
    files = sorted(p for p in (step_dir / "model").iterdir())
    down, back, wired = c.landed
    raw_key = f"raw/{c.size}/{rep}"
    raw_keys, sizes = [f"{raw_key}/{f.name}" for f in files], [f.stat().st_size for f in files]

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def raw_up() -> None:
        for f in files:
            c.client.upload_file(str(f), c.bucket, f"{raw_key}/{f.name}", Config=c.transfer)

    def raw_down() -> None:
        for f in files:
            c.client.download_file(c.bucket, f"{raw_key}/{f.name}", str(down / f.name), Config=c.transfer)

    ups_order = [(raw_up, ups.raw), (lambda: c.remote.upload_step(step_dir), ups.measured)]
    for fn, into in ups_order if rep % 2 == 0 else ups_order[::-1]:
        into.append(timed(fn))
    restored: list[float] = []
    downs_order = [
        (lambda: _wire_download(c, raw_keys, sizes, wired), wire.raw),
        (lambda: c.remote.download_step(step, RunLayout(back, "bench"), f"r{rep}"), restored),
    ]
    downs_order = downs_order if rep % 2 == 0 else downs_order[::-1]
    downs_order.insert((rep // 2) % 3, (raw_down, downs.raw))
    for fn, into in downs_order:
        c.settle()
        into.append(timed(fn))
    downs.measured += restored
    wire.measured += restored
    shutil.rmtree(step_dir)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint-url", default=os.environ.get("S3_ENDPOINT_URL"))
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=args.endpoint_url).create_bucket(Bucket=bucket)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        results = [
            measure(bucket, args.endpoint_url, size, args.repeats, args.concurrency, Path(td)) for size in args.sizes_mb
        ]
    for r in results:
        print(
            f"{r['size_mb']} MB: promotion / upload_file throughput {r['promotion']['ratio']:.2f} "
            f"{r['promotion']['ratio_spread']}; verified restore / the same ranged GETs unverified "
            f"{r['restore']['ratio']:.2f}x {r['restore']['ratio_spread']}; / download_file "
            f"{r['restore']['download_file']['ratio']:.2f}x {r['restore']['download_file']['ratio_spread']}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
