"""Tier 3 throughput on a real S3 server, each as a ratio to raw boto3 on the same bytes in the same run:

* promotion (``RemoteTier.upload_step``: objects, the local step verified while they upload, size
  checks, manifest, COMMITTED, latest.json) / ``upload_file`` of the same files;
* restore (one ranged GET per digest chunk, in parallel, each checked as it arrives and written
  once, then the local publish) / ``download_file`` of the same files.

Both pairs alternate which path runs first, and report median and spread (:mod:`bench.pairs`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig

from bench.pairs import Pair
from tiering.collective import SingleProcess
from tiering.digest import DEFAULT_CHUNK_BYTES, PORTABLE_HASH, HashSpec
from tiering.layout import RunLayout
from tiering.objectstore import open_store
from tiering.publish import PosixStepPublisher, manifest_for
from tiering.remote import RemoteTier


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


def measure(client: Any, bucket: str, endpoint: str, size: int, repeats: int, concurrency: int, td: Path) -> dict:
    """Alternating pairs: promotion vs ``upload_file`` and verified restore vs ``download_file``."""
    transfer = TransferConfig(multipart_chunksize=64 * 1024 * 1024, max_concurrency=concurrency)
    store, prefix = open_store(f"s3://{bucket}/tier{size}", endpoint, concurrency)
    remote = RemoteTier(store, prefix, "bench", concurrency)
    ups, downs = Pair(), Pair()
    for rep in range(repeats):
        _repeat(_Case(client, bucket, remote, transfer, size, rep, td), ups, downs)
        # Free the server (a memstore RGW holds objects in RAM) before the next repeat.
        store.delete([o.key for o in store.list(prefix)] + [o.key for o in store.list(f"raw/{size}/{rep}/")])
    return {"size_mb": round(size * 1.048576), "promotion": ups.summary("throughput"), "restore": downs.summary("time")}


@dataclass
class _Case:
    client: Any
    bucket: str
    remote: RemoteTier
    transfer: TransferConfig
    size: int
    rep: int
    td: Path


def _repeat(c: _Case, ups: Pair, downs: Pair) -> None:
    """One repeat of both pairs; the raw path goes first on even repeats, second on odd ones."""
    step = 10 * (c.rep + 1)
    step_dir = make_step(c.td / f"s{c.size}", step, c.size)
    files = sorted(p for p in (step_dir / "model").iterdir())
    down, back = c.td / f"down{c.size}-{c.rep}", c.td / f"back{c.size}-{c.rep}"
    down.mkdir()
    raw_key = f"raw/{c.size}/{c.rep}"

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

    pairs = (
        (ups, lambda: c.remote.upload_step(step_dir), raw_up),
        (downs, lambda: c.remote.download_step(step, RunLayout(back, "bench"), f"r{c.rep}"), raw_down),
    )
    for pair, measured, raw in pairs:
        if c.rep % 2 == 0:
            pair.raw.append(timed(raw))
            pair.measured.append(timed(measured))
        else:
            pair.measured.append(timed(measured))
            pair.raw.append(timed(raw))
    for path in (down, back, step_dir):
        shutil.rmtree(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint-url", default=os.environ.get("S3_ENDPOINT_URL"))
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    client = boto3.client("s3", endpoint_url=args.endpoint_url)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        results = [
            measure(client, bucket, args.endpoint_url, size, args.repeats, args.concurrency, Path(td))
            for size in args.sizes_mb
        ]
    for r in results:
        print(
            f"{r['size_mb']} MB: promotion / upload_file throughput {r['promotion']['ratio']:.2f} "
            f"{r['promotion']['ratio_spread']}; verified restore / download_file {r['restore']['ratio']:.2f}x "
            f"{r['restore']['ratio_spread']}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
