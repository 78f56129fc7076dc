"""Stragglers: a rank slowed from outside the job (its process in a cgroup with a CPU quota) is
named, with its node, by rank 0's straggler report once the cap has run for a whole report
interval; in a run nobody slows, no rank is named and no node excluded. Bad
``fault_tolerance.straggler`` values are one-line errors."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from pretrain.config import load_config, validate
from pretrain.errors import ConfigError
from pretrain.resilience.phases import ranks_in_phase
from pretrain.resilience.stragglers import compute_only
from tests.cpu_throttle import CpuCap
from tests.helpers import TINY, events, metrics_by_step, overrides_for, torchrun

INTERVAL = 5
STEPS = 40
THRESHOLD = 0.3
THROTTLE_AFTER = 12  # steps: two clean reports first
COMMON = {
    "train.steps": STEPS,
    "fault_tolerance.straggler.report_interval": INTERVAL,
    # This test host runs many jobs on 2 cores (load 20-30): a clean rank's relative score dipped
    # to 0.39 in its first reports; a rank held to half its CPU share scores 0.11-0.19.
    "fault_tolerance.straggler.threshold": THRESHOLD,
    "checkpoint.local.interval": 1000,
    "checkpoint.reshardable.interval": 1000,
}


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("threshold", "0", "must be in (0, 1]"),
        ("threshold", "1.5", "must be in (0, 1]"),
        ("patience", "0", ">= 1"),
        ("action", "evict", "unknown action 'evict'"),
    ],
)
def test_a_bad_straggler_setting_is_a_one_line_error_with_the_fix(key: str, value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(load_config(TINY, [f"fault_tolerance.straggler.{key}={value}"]), 2, cuda=False)
    msg = str(err.value)
    assert "\n" not in msg and f"fault_tolerance.straggler.{key}" in msg and problem in msg and "fix:" in msg, msg


# The cap rank 1 gets. Not "half of what it used": a rank idles in every gradient all-reduce, so its
# CPU use is bursty, and a 50 % quota per 10 ms period let a short forward run at full speed after
# each idle wait (on a fast CI host the capped rank scored 0.73 of its own best and was not named).
# A tenth of a CPU binds on any host: each forward spans several periods.
CAP_CPU = 0.1


def _cap(run_dir: Path, record: Path) -> CpuCap:
    """Rank 1 capped at ``CAP_CPU`` from outside the job once it has trained ``THROTTLE_AFTER`` steps."""

    def rank_1() -> int | None:
        pids = ranks_in_phase(run_dir, None, "training", [1])
        return pids[1] if pids else None

    def step() -> int:
        return max(metrics_by_step(run_dir), default=0)

    return CpuCap(rank_1, step, THROTTLE_AFTER, record, cap=CAP_CPU)


def _reports(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e["event"] == "straggler_report"]


@pytest.mark.slow
def test_a_rank_slowed_from_outside_is_named_with_its_node(tmp_path: Path, corpus: Path) -> None:
    run_dir = tmp_path / "runs" / "t"
    slow = _cap(run_dir, tmp_path / "throttle.json")
    slow.start()
    try:
        torchrun(tmp_path, 2, overrides_for(tmp_path, corpus, **COMMON), timeout=600)
    finally:
        slow.stop.set()
        slow.join(timeout=30)
    assert slow.error is None and slow.done, (slow.error, slow.done)
    assert not Path(slow.done["cgroup"]).exists()
    reports = _reports(run_dir)
    assert [r["step"] for r in reports] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    throttled_at = slow.done["step"]
    # Named within the run's fully throttled reports (the cap began at step 12-13: five reports,
    # 25 steps). Not at an exact report, and nothing is asserted on reports from before the cap:
    # on a loaded host a report can find the clean rank starved for its interval (a score below
    # the threshold, or rank 1 above it once); that is load, not the detector (the clean run below
    # and bench/straggler_numbers.py measure it).
    full = [r for r in reports if r["step"] - INTERVAL >= throttled_at]
    named = [r for r in reports if r["step"] > throttled_at and 1 in r["slow_ranks"]]
    assert full and any(1 in r["slow_ranks"] for r in full), reports
    first = named[0]
    assert first["slow_ranks"] == [1] and first["slow_nodes"] == [socket.gethostname()], first
    scores = {s["rank"]: s for s in first["scores"]}
    assert scores[0]["relative"] == pytest.approx(1.0) and scores[1]["relative"] < THRESHOLD, scores  # float32
    log = (tmp_path / "job.log").read_text()
    assert f"step {first['step']} | stragglers: rank 1 on {socket.gethostname()}" in log


@pytest.mark.slow
def test_a_run_nobody_slows_names_no_straggler_and_excludes_no_node(tmp_path: Path, corpus: Path) -> None:
    over = {**COMMON, "fault_tolerance.straggler.action": "restart_without", "fault_tolerance.straggler.patience": 2}
    torchrun(tmp_path, 2, overrides_for(tmp_path, corpus, **over), timeout=600)
    run_dir = tmp_path / "runs" / "t"
    reports = _reports(run_dir)
    assert [r["step"] for r in reports] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert all(r["slow_ranks"] == [] and len(r["scores"]) == 2 for r in reports), reports
    assert not (run_dir / "excluded-nodes.jsonl").exists()


def test_the_gpu_score_is_computed_from_compute_kernels_only() -> None:
    """NCCL kernels run longer on the fast ranks (they wait for the slow one): never scored (issue 45 #12)."""
    summaries = {
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)_4_64_1": {"med": 9.0},
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t_8_256_1": {"med": 3.0},
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>_8_128_1": {"med": 0.1},
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_1_128_1": {"med": 1.2},
    }
    kept = compute_only(summaries)
    assert sorted(kept) == sorted(k for k in summaries if not k.lower().startswith("nccl"))
    assert compute_only({}) == {}
