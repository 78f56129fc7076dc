"""The multi-node all-reduce check (``scripts/gpu-check.sh --multi-node``), dry run on CPU: two real
gloo ranks report the bus bandwidth nccl-tests would, and a floor above it fails in one line."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pretrain.platform.allreduce_check import bus_bandwidth
from tests.helpers import REPO


def test_bus_bandwidth_is_nccl_tests_figure() -> None:
    alg, bus = bus_bandwidth(nbytes=8 * 10**9, seconds=0.1, world=16)
    assert alg == pytest.approx(80.0) and bus == pytest.approx(80.0 * 2 * 15 / 16)


def _check(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["scripts/gpu-check.sh", "--cpu", "--multi-node"],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_dry_run_measures_an_all_reduce_across_two_ranks_and_a_floor_fails_in_one_line() -> None:
    done = _check()
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("{")))
    assert figures["world_size"] == 2 and figures["backend"] == "gloo" and figures["bytes"] == 8 * 2**20
    assert figures["busbw_gbs"] > 0 and figures["busbw_gbs"] == pytest.approx(figures["algbw_gbs"], rel=0.01)
    low = _check(MIN_BUSBW_GBS="1000000")
    assert low.returncode != 0
    [line] = [x for x in low.stderr.splitlines() if x.startswith("allreduce check:")]
    assert "is below 1000000.0 GB/s; fix:" in line and "NET/OFI" in line
