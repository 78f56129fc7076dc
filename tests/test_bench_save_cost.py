"""bench/save_cost.py's judgement in process: a job's step excess per save from its records, and the
tier-1 writer mode chosen only when the two modes' spreads do not overlap."""

from __future__ import annotations

from typing import Any

import pytest

from bench.save_cost import default_mode, job_save_cost, summarise


def _job(after_save: float, tier: str = "local") -> list[dict[str, Any]]:
    """11 steps of 1.0 s; the step after each save at 3, 6, 9 takes ``after_save``; the final save
    (step 11, no step after it) has a huge blocked time that must not count."""
    rows, t = [], 0.0
    for step in range(1, 12):
        t += after_save if step - 1 in (3, 6, 9) else 1.0
        rows.append({"attempt": "a", "step": step, "time": t, "loss": 1.0})
    saves = [{"attempt": "a", "event": "save", "tier": tier, "step": s, "blocked_seconds": 0.05} for s in (3, 6, 9)]
    saves.append({"attempt": "a", "event": "save", "tier": tier, "step": 11, "blocked_seconds": 9.0})
    return [*saves, {"event": "metrics", "rows": rows}]


def test_a_jobs_cost_per_save_is_its_step_excess_not_its_blocked_time() -> None:
    cost = job_save_cost(_job(1.8), "local", last_step=11)
    assert cost["blocked_s"] == pytest.approx(0.05) and cost["step_excess_s"] == pytest.approx(0.8)
    assert cost["cost_s"] == pytest.approx(0.8) and cost["plain_step_s"] == pytest.approx(1.0)
    assert job_save_cost(_job(1.8), "memory", last_step=11) is None  # no tier-0 save in this job


def _case(costs: list[float]) -> dict[str, Any]:
    return summarise([{"blocked_s": 0.01, "step_excess_s": c, "cost_s": c, "plain_step_s": 1.0, "mean_step_s": 1.2}
                      for c in costs])  # fmt: skip


def test_the_default_mode_is_chosen_only_outside_the_noise() -> None:
    apart = default_mode({"tier1-thread": _case([0.2, 0.25, 0.3]), "tier1-fork": _case([0.6, 0.7, 0.9])})
    assert apart["mode"] == "thread" and not apart["within_noise"]
    overlap = default_mode({"tier1-thread": _case([0.2, 2.1, 2.7]), "tier1-fork": _case([0.8, 1.7, 2.7])})
    assert overlap["mode"] is None and overlap["smaller_median"] == "fork" and overlap["within_noise"]
    assert default_mode({"tier1-thread": _case([0.2])})["mode"] is None
