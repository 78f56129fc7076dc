"""A throttling, flaky object store: the real Ceph RGW behind a fault-injecting proxy on the cluster's
bridge (server side). During a burst requests get 503 SlowDown, a connection reset or (for a
multipart part, none of which gets through) a stall mid-part; the uploader runs in a node namespace as ``tiering upload
--watch``, while new steps keep arriving in staging. It retries with capped, jittered backoff; no
step is ever visible as COMMITTED before every object of its manifest is there with its size; once
the store recovers it catches up, and every promoted byte verifies."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import boto3
import pytest

from tests.cluster.netns import Cluster, unavailable
from tests.cluster.s3proxy import FaultProxy
from tests.helpers import PYTHON, REPO
from tests.test_s3_tier import make_step, run_key_file  # noqa: F401 (the run key fixture: autouse)
from tiering.digest import hash_bytes
from tiering.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))]

BURST_S = float(os.environ.get("RP16_BURST_S", "12"))  # the closing note's 60 s: RP16_BURST_S=60
RETRY_MAX_S = 4.0
STEPS = (10, 20, 30)


class CommitWatch(threading.Thread):
    """Lists the bucket directly (not through the proxy) every 0.1 s: when each step's COMMITTED
    first appeared, and any moment a COMMITTED step lacked an object of its manifest."""

    def __init__(self, endpoint: str, bucket: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.s3 = boto3.client("s3", endpoint_url=endpoint)
        self.bucket, self.prefix = bucket, prefix
        self.committed_at: dict[int, float] = {}
        self.violations: list[str] = []
        self.halt = threading.Event()

    def _scan(self) -> None:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        sizes = {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}
        for key in sizes:
            if not key.endswith("/COMMITTED"):
                continue
            step_dir = key.rsplit("/", 1)[0]
            step = int(step_dir.rsplit("-", 1)[1])
            if step in self.committed_at:
                continue
            self.committed_at[step] = time.monotonic()
            raw = self.s3.get_object(Bucket=self.bucket, Key=f"{step_dir}/manifest.json")["Body"].read()
            manifest = json.loads(raw)
            for entry in manifest["files"]:
                if sizes.get(f"{step_dir}/{entry['path']}") != entry["bytes"]:
                    self.violations.append(f"step {step} COMMITTED while {entry['path']} was not complete")

    def run(self) -> None:
        while not self.halt.is_set():
            self._scan()
            time.sleep(0.1)


def _delays(log: str) -> list[float]:
    return [float(x.split("retrying in ")[1].split("s;")[0]) for x in log.splitlines() if "retrying in" in x]


def _verify_every_byte(endpoint: str, bucket: str, step: int) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    base = f"ckpt/t/steps/step-{step:09d}"
    raw = s3.get_object(Bucket=bucket, Key=f"{base}/manifest.json")["Body"].read()
    for entry in Manifest.from_json(raw, base).files:
        data = s3.get_object(Bucket=bucket, Key=f"{base}/{entry.path}")["Body"].read()
        chunks = tuple(
            hash_bytes(entry.hash, data[i : i + entry.chunk_bytes]) for i in range(0, len(data), entry.chunk_bytes)
        )
        assert len(data) == entry.bytes and chunks == entry.chunks, (step, entry.path)


def test_uploader_rides_out_a_throttling_flaky_store(s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    for step in STEPS[:2]:
        make_step(staging, step, size=6_000_000, shards=2)  # two 6 MB shards: multipart, 2 parts each
    watch = CommitWatch(s3_endpoint, bucket, "ckpt/t/")
    with Cluster(tmp_path / "cluster", 1) as cluster:
        proxy = FaultProxy(cluster.gateway, s3_endpoint, stall_s=2.0)
        try:
            argv = [PYTHON, "-m", "tiering", "upload", f"s3://{bucket}/ckpt", "--run-id", "t"]
            argv += ["--staging-dir", str(staging), "--endpoint-url", proxy.url, "--watch", "--poll-s", "0.5"]
            argv += ["--retry-max-s", str(RETRY_MAX_S), "--multipart-chunk-mb", "5", "--max-seconds", "240"]
            argv += ["--max-attempts", "2"]  # errors reach the uploader's own backoff within the burst
            env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
            proxy.burst(BURST_S)
            burst_end = time.monotonic() + BURST_S
            watch.start()
            uploader = cluster.popen(0, argv, env, tmp_path / "uploader.log")
            time.sleep(BURST_S / 2)  # the trainer keeps publishing while the store throttles
            make_step(staging, STEPS[2], size=6_000_000, shards=2)
            deadline = burst_end + 60
            while set(STEPS) - set(watch.committed_at) and time.monotonic() < deadline:
                assert uploader.poll() is None, (tmp_path / "uploader.log").read_text()[-3000:]
                time.sleep(0.1)
            uploader.send_signal(signal.SIGTERM)
            uploader.wait(timeout=30)
        finally:
            watch.halt.set()
            proxy.close()
    log = (tmp_path / "uploader.log").read_text()
    (tmp_path / "proxy.log").write_text("\n".join(f"{t:.3f} {kind} {line}" for t, kind, line in proxy.requests))
    assert sorted(watch.committed_at) == list(STEPS), log[-3000:]
    assert not watch.violations, watch.violations
    assert min(watch.committed_at.values()) >= burst_end, "no step can complete during the burst"
    assert proxy.counts["slowdown"] and proxy.counts["reset"] and proxy.counts["stall"], proxy.counts
    delays = _delays(log)
    ceilings = [min(RETRY_MAX_S, 2.0**i) for i in range(len(delays))]
    assert delays and all(c / 2 <= d <= c for d, c in zip(delays, ceilings)), delays
    assert any(d < 0.98 * c for d, c in zip(delays, ceilings)), f"no jitter in {delays}"
    for step in STEPS:
        _verify_every_byte(s3_endpoint, bucket, step)
    catch_up = max(watch.committed_at.values()) - burst_end
    print("S3_THROTTLE", json.dumps({"burst_s": BURST_S, "catch_up_s": round(catch_up, 2), **proxy.counts}))
    assert catch_up < RETRY_MAX_S + 20, f"caught up {catch_up:.1f}s after the store recovered"
