"""The GPU check's snapshot bench sizes its state to the machine (tests/gpu/snapshot_bench.py):
five durable writes of it must fit the disk and the time budget, and the state the GPU."""

from __future__ import annotations

from pathlib import Path

from tests.gpu.snapshot_bench import BYTES_PER_PARAM, CHUNKS, WRITES, plan_params, probe_write_speed

GB = 10**9
FULL = 800_000_000


def test_the_full_model_when_disk_memory_and_time_allow() -> None:
    assert plan_params(FULL, free_disk=500 * GB, free_gpu=140 * GB, write_bytes_per_s=2 * GB, budget_s=120) == (
        FULL,
        "model",
    )


def test_a_small_disk_halves_its_free_space_for_one_file_at_a_time() -> None:
    params, limited_by = plan_params(FULL, free_disk=10 * GB, free_gpu=140 * GB, write_bytes_per_s=2 * GB, budget_s=120)
    assert limited_by == "disk" and params * BYTES_PER_PARAM <= 5 * GB and params % CHUNKS == 0
    assert params * BYTES_PER_PARAM > 5 * GB - CHUNKS * BYTES_PER_PARAM


def test_a_slow_disk_keeps_the_five_writes_within_half_the_budget() -> None:
    params, limited_by = plan_params(FULL, free_disk=500 * GB, free_gpu=None, write_bytes_per_s=0.3 * GB, budget_s=120)
    assert limited_by == "time"
    assert WRITES * params * BYTES_PER_PARAM / (0.3 * GB) <= 60


def test_gpu_memory_bounds_the_state() -> None:
    params, limited_by = plan_params(FULL, free_disk=500 * GB, free_gpu=10 * GB, write_bytes_per_s=2 * GB, budget_s=120)
    assert limited_by == "gpu_memory" and params * BYTES_PER_PARAM <= 7 * GB


def test_the_write_probe_measures_a_real_durable_write(tmp_path: Path) -> None:
    speed = probe_write_speed(tmp_path, 4 << 20)
    assert speed > 0 and not (tmp_path / "probe.pt").exists()
