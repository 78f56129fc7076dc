"""The uploader's Prometheus metrics, scraped over HTTP from a real ``tiering upload --watch``: the
newest promoted step and its time, seeded from the store on a restart (a restarted uploader must
not look fresh to the S3 ``CheckpointStale`` rule), and failures while the store is unreachable."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import PYTHON, free_port
from tests.test_s3_tier import RUN, make_step, run_key_file  # noqa: F401 (the run key fixture: autouse)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@contextmanager
def uploader(staging: Path, uri: str, *extra: str) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    port = free_port()
    argv = [PYTHON, "-m", "tiering", "upload", uri, "--run-id", RUN, "--staging-dir", str(staging)]
    argv += ["--watch", "--poll-s", "0.2", "--retry-max-s", "0.5", "--metrics-port", str(port), *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(port: int, proc: subprocess.Popen[str], done, timeout: float = 90.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        try:
            last = scrape(port)
        except OSError:
            time.sleep(0.2)
            continue
        if done(last):
            return last
        time.sleep(0.2)
    raise AssertionError(f"metrics never got there: {last}")


RID = (("run_id", RUN),)


def test_promotions_are_exported_and_a_restarted_uploader_reports_the_stores_commit_time(tmp_path: Path) -> None:
    staging, store = tmp_path / "staging", tmp_path / "store"
    make_step(staging, 10)
    uri = f"file://{store}"
    before = time.time()
    with uploader(staging, uri) as (port, proc):
        got = wait_for(port, proc, lambda m: m.get(("uploader_last_promoted_step", RID)) == 10)
        promoted_at = got[("uploader_last_promoted_timestamp_seconds", RID)]
        assert before <= promoted_at <= time.time()
        assert got[("uploader_pending_steps", RID)] == 0
        assert 0 <= got[("uploader_last_promoted_age_seconds", RID)] < 60
        assert got[("uploader_failures_total", (("reason", "store"), *RID))] == 0
    committed = next(store.rglob("step-000000010/COMMITTED"))
    os.utime(committed, (before - 3600, before - 3600))  # promoted an hour ago, as far as the store says
    with uploader(staging, uri) as (port, proc):
        got = wait_for(port, proc, lambda m: ("uploader_last_promoted_step", RID) in m)
        assert got[("uploader_last_promoted_step", RID)] == 10
        assert abs(got[("uploader_last_promoted_timestamp_seconds", RID)] - (before - 3600)) < 1
        assert got[("uploader_last_promoted_age_seconds", RID)] >= 3600


def test_an_unreachable_store_counts_failures(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    make_step(staging, 10)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    extra = ("--endpoint-url", dead, "--max-attempts", "1")
    with uploader(staging, "s3://nobody/ckpt", *extra) as (port, proc):
        got = wait_for(port, proc, lambda m: m.get(("uploader_failures_total", (("reason", "store"), *RID)), 0) >= 2)
        assert ("uploader_last_promoted_step", RID) not in got
