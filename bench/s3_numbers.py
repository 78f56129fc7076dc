"""Tier 3 throughput on a real S3 server, each as a ratio to raw boto3 on the same bytes in the same run:

* promotion (``RemoteTier.upload_step``: objects + size checks + manifest + COMMITTED + latest.json,
  with the SHA-256 already in the manifest) / ``upload_file`` of the same files;
* restore (download in parallel + SHA-256 of every byte + local publish) / ``download_file``.

Run: ``python -m bench.s3_numbers --endpoint-url http://127.0.0.1:7480 --sizes-mb 300 2000``
(AWS_* credentials from the environment; Ceph RGW test keys are testing/testing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig

from tiering.collective import SingleProcess
from tiering.layout import RunLayout
from tiering.objectstore import open_store
from tiering.publish import PosixStepPublisher, manifest_for
from tiering.remote import RemoteTier


def make_step(root: Path, step: int, total_mb: int, shards: int = 4) -> Path:
    layout = RunLayout(root, "bench")
    pub = PosixStepPublisher(layout, SingleProcess(), f"a{step}")
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint-url", default=os.environ.get("S3_ENDPOINT_URL"))
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    client = boto3.client("s3", endpoint_url=args.endpoint_url)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    transfer = TransferConfig(multipart_chunksize=64 * 1024 * 1024, max_concurrency=args.concurrency)
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        for size in args.sizes_mb:
            rows = []
            for rep in range(args.repeats):
                step_dir = make_step(Path(td) / f"s{size}", 10 * (rep + 1), size)
                files = sorted(p for p in (step_dir / "model").iterdir())
                t0 = time.perf_counter()
                for f in files:
                    client.upload_file(str(f), bucket, f"raw/{size}/{rep}/{f.name}", Config=transfer)
                raw_up = time.perf_counter() - t0
                store, prefix = open_store(f"s3://{bucket}/tier{size}", args.endpoint_url, args.concurrency)
                remote = RemoteTier(store, prefix, "bench", args.concurrency)
                t1 = time.perf_counter()
                remote.upload_step(step_dir)
                tier_up = time.perf_counter() - t1
                down = Path(td) / f"down{size}-{rep}"
                down.mkdir()
                t2 = time.perf_counter()
                for f in files:
                    client.download_file(bucket, f"raw/{size}/{rep}/{f.name}", str(down / f.name), Config=transfer)
                raw_down = time.perf_counter() - t2
                t3 = time.perf_counter()
                remote.download_step(10 * (rep + 1), RunLayout(Path(td) / f"back{size}", "bench"), f"r{rep}")
                tier_down = time.perf_counter() - t3
                rows.append({"raw_up": raw_up, "tier_up": tier_up, "raw_down": raw_down, "tier_down": tier_down})
                for path in list(down.iterdir()) + files:
                    path.unlink()
                # Free the server (a memstore RGW holds objects in RAM) before the next repeat.
                keys = [o.key for o in store.list(prefix)] + [f"raw/{size}/{rep}/{f.name}" for f in files]
                store.delete(keys)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            mb = size * 1.048576
            results.append(
                {
                    "size_mb": round(mb),
                    **{k: round(v, 3) for k, v in med.items()},
                    "promotion_ratio": round(med["raw_up"] / med["tier_up"], 3),
                    "restore_ratio": round(med["tier_down"] / med["raw_down"], 3),
                }
            )
            r = results[-1]
            print(
                f"{r['size_mb']} MB: promotion {mb / med['tier_up']:.0f} MB/s vs raw upload_file "
                f"{mb / med['raw_up']:.0f} MB/s -> throughput ratio {r['promotion_ratio']:.2f}; restore "
                f"{med['tier_down']:.2f} s vs raw download_file {med['raw_down']:.2f} s -> {r['restore_ratio']:.2f}x"
            )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
