"""The soak report, in-process: the seconds from a fault to the next attempt's first step are split
at the boundaries the records hold, and the parts add up to the whole; a store fault is judged by
the uploader's own metrics (read from a real exporter's page) and by no attempt starting meanwhile;
the planner's goodput is computed from the costs the soak measured."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pretrain.soak.inject import Injected
from pretrain.soak.projection import planner_projection, projection_line
from pretrain.soak.report import BREAKDOWN, fault_row, recovery_breakdown
from pretrain.soak.runner import FaultEvent
from pretrain.soak.schedule import PlannedFault
from pretrain.soak.uploader import parse_metrics
from tiering.remote.uploader import UploaderMetrics

NEXT = {"id": "b", "process_started_at": 103.0, "started_at": 109.0}
RESTORE = {"event": "restore", "attempt": "b", "time": 111.0, "seconds": 0.5}
FIRST = {"attempt": "b", "step": 11, "time": 111.25}


def test_a_recovery_splits_into_detection_restart_startup_build_restore_and_first_step() -> None:
    parts = recovery_breakdown(100.0, 102.5, NEXT, RESTORE, FIRST)
    assert parts == {
        "detection": 2.5, "launcher_restart": 0.5, "startup_imports_pg": 6.0, "build": 1.5, "restore": 0.5,
        "first_step": 0.25,
    }  # fmt: skip
    assert list(parts) == list(BREAKDOWN) and sum(parts.values()) == pytest.approx(FIRST["time"] - 100.0)


def test_a_fresh_start_has_no_restore_and_a_missing_boundary_gives_no_breakdown() -> None:
    fresh = {"event": "fresh_start", "attempt": "b", "time": 110.0}
    parts = recovery_breakdown(100.0, 101.0, NEXT, fresh, FIRST)
    assert parts is not None and parts["restore"] == 0.0 and parts["build"] == 1.0
    assert recovery_breakdown(100.0, None, NEXT, RESTORE, FIRST) is None
    assert recovery_breakdown(100.0, 101.0, NEXT, {}, FIRST) is None
    assert recovery_breakdown(100.0, 101.0, NEXT, RESTORE, None) is None


def test_the_uploader_page_gives_its_store_failures_and_newest_promotion() -> None:
    metrics = UploaderMetrics("soak")
    fresh = parse_metrics(generate_latest(metrics.registry).decode(), 5.0)
    assert (fresh.store_failures, fresh.promoted_step, fresh.promoted_at) == (0.0, None, None)
    metrics.failed("store")
    metrics.failed("verification")  # another reason: not the store's
    metrics.promoted(20, 1234.5)
    got = parse_metrics(generate_latest(metrics.registry).decode(), 6.0)
    assert (got.time, got.store_failures, got.promoted_step, got.promoted_at) == (6.0, 1.0, 20, 1234.5)


def _store_event(recorded: bool) -> FaultEvent:
    plan = PlannedFault(index=0, kind="s3-unreachable", rank=1, gap_s=0.0, gap_steps=4)
    event = FaultEvent(plan, "a", Injected(100.0, [], [], {"held_connections": 2}), [11, 12])
    event.released_at, event.recovered_at = 110.0, 112.5
    if recorded:
        event.gone_at = 104.0
        event.recorded = {
            "reason": "store", "uploader_failures_total": [0.0, 1.0], "promoted_step_at_fault": 20,
            "promoted_step_after": 40, "time": 104.0,
        }  # fmt: skip
    return event


def test_a_store_fault_is_recorded_by_the_uploader_and_restarts_nothing() -> None:
    rows = [{"attempt": "a", "step": s, "time": 99.0 + s} for s in range(1, 15)]  # 9 of them while cut
    row = fault_row(_store_event(True), [{"id": "a", "started_at": 90.0}], rows, [], 0.0)
    assert row["record_matches"] and row["recovered"] and row["recorded_class"] == row["expected_class"] == "store"
    assert (row["detection_s"], row["outage_s"], row["back_s"], row["fault_to_next_step_s"]) == (4.0, 10.0, 2.5, 12.5)
    assert row["lost_steps"] == 0 and row["restarted_during"] == [] and "no attempt started" in row["evidence"]
    assert row["steps_trained_while_cut"] == 10 and "(10 steps trained meanwhile)" in row["evidence"]


def test_a_store_fault_is_a_mismatch_when_an_attempt_started_meanwhile_or_nothing_was_recorded() -> None:
    attempts = [{"id": "a", "started_at": 90.0}, {"id": "b", "started_at": 111.0}]
    restarted = fault_row(_store_event(True), attempts, [], [], 0.0)
    assert not restarted["record_matches"] and restarted["restarted_during"] == ["b"]
    silent = fault_row(_store_event(False), attempts[:1], [], [], 0.0)
    assert not silent["record_matches"] and silent["recorded_class"] == "not recorded" and silent["detection_s"] is None


def test_the_planners_projection_takes_the_costs_the_soak_measured() -> None:
    """1 - save/interval - (restart + interval/2) / MTBF, every input measured: 0.1 s steps and 5 %
    of the baseline's time in checkpoints at a 10-step interval (save 0.05 s every 1 s), two
    restarts of 2 and 4 s in 100 s of wall (MTBF 50 s): 1 - 0.05 - 3.5 / 50 = 0.88. A fault that
    does not restart the job (a full disk) is not an interruption."""
    report = {
        "faults": [
            {"kind": "kill-rank", "fault_to_next_step_s": 2.0, "lost_steps": 4},
            {"kind": "sigsegv", "fault_to_next_step_s": 4.0, "lost_steps": 6},
            {"kind": "full-disk", "fault_to_next_step_s": 1.0, "lost_steps": 0},
        ],
        "goodput": {
            "faulted": {"wall_s": 100.0, "goodput_ratio": 0.8},
            "baseline": {"wall_s": 100.0, "productive_s": 90.0, "steps_run": 900, "badput_s": {"checkpoint": 5.0}},
        },
    }
    projection = planner_projection(report, interval_steps=10)
    assert projection["projected"] == pytest.approx(0.88)
    inputs = projection["inputs"]
    assert (inputs["mtbf_s"], inputs["restarts"], inputs["restart_s"]) == (50.0, 2, 3.0)
    assert (inputs["interval_s"], inputs["save_s"]) == (pytest.approx(1.0), pytest.approx(0.05))
    assert inputs["lost_work_model_s"] == 0.5 and inputs["lost_work_measured_s"] == pytest.approx(0.5)
    assert projection_line(projection).startswith("planner's projection : 88.0% for the measured costs against 80.0%")
    report["faults"] = report["faults"][2:]
    assert planner_projection(report, 10)["projected"] is None
