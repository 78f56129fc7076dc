"""The soak report's recovery breakdown, in-process: the seconds from a fault to the next attempt's
first step are split at the boundaries the records hold, and the parts add up to the whole."""

from __future__ import annotations

import pytest

from pretrain.soak.report import BREAKDOWN, recovery_breakdown

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
