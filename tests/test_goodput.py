"""Goodput from records, in-process: a run of two attempts written as the rank program writes its
records is split into productive seconds and badput by cause with nothing left over; the same split
reaches Prometheus and ``pretrain status --goodput``; the Grafana dashboard plots only metrics the
code exports."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pretrain.cli import main
from pretrain.observability.goodput import CAUSES, GoodputCollector, goodput_from_records, goodput_of
from pretrain.observability.metrics import TrainingMetrics
from tests.helpers import PYTHON
from tiering.remote.uploader import UploaderMetrics

REPO = Path(__file__).resolve().parents[1]


def _rows(attempt: str, steps_times: list[tuple[int, float]]) -> list[dict[str, Any]]:
    return [{"step": s, "time": t, "attempt": attempt, "loss": 1.0} for s, t in steps_times]


def two_attempts(second_status: str = "succeeded", first_status: str = "failed") -> tuple[list, list, list]:
    """Attempt a: start-up 10 s, steps 1-8 one second each except a save inside step 6 (+1 s), fails
    at t=19. Attempt b: starts at 25, restores step 5 in 2 s, 3 s more start-up, recomputes 6-8,
    trains 9-10 and ends 1 s after its last step (the final save)."""
    a = {"id": "a", "attempt": 1, "status": first_status, "process_started_at": 0.0, "ended_at": 19.0}
    b = {
        "id": "b", "attempt": 2, "status": second_status, "process_started_at": 25.0, "ended_at": 36.0,
        "restored": {"tier": "local", "step": 5, "seconds": 2.0},
    }  # fmt: skip
    rows = _rows("a", [(k, 10.0 + k) for k in range(1, 6)] + [(6, 17.0), (7, 18.0), (8, 19.0)])
    rows += _rows("b", [(6, 31.0), (7, 32.0), (8, 33.0), (9, 34.0), (10, 35.0)])
    return [a, b], rows, [(15.5, 15.5)]


def test_two_attempts_split_into_productive_time_and_badput_by_cause_with_nothing_left_over() -> None:
    attempts, rows, saves = two_attempts()
    g = goodput_of(attempts, rows, saves, [])
    assert g.wall_s == 36.0 and g.productive_s == pytest.approx(10.0)
    want = {"startup": 10.0, "detection_restart": 9.0, "restore": 2.0, "recomputed_steps": 3.0, "checkpoint": 2.0}
    assert g.badput_s == pytest.approx({c: want.get(c, 0.0) for c in CAUSES})
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)
    assert g.steps == 10 and g.steps_run == 13 and g.ratio == pytest.approx(10 / 36)


def test_records_that_overlap_are_counted_once_so_the_parts_still_sum_to_the_wall_time() -> None:
    """The clean-clone soak failure: parts 110.806 s against 110.392 s of wall. Attempt b's process
    start (psutil's create_time, up to a second early) fell 0.4 s before attempt a's end (rank 0's
    clock): the launcher had restarted within that second. Its restore (2 s recorded) and first step
    also do not fit the 1.5 s between that end and its first row."""
    attempts, rows, saves = two_attempts()
    attempts[1]["process_started_at"] = 18.6
    rows = [r for r in rows if r["attempt"] == "a"] + _rows("b", [(6, 20.5), (7, 21.5), (8, 22.5), (9, 23.5)])
    attempts[1]["ended_at"] = 24.0
    g = goodput_of(attempts, rows, saves, [])
    assert g.wall_s == 24.0
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s, abs=1e-9)
    # a's end to b's first row: 1.5 s, its first step's median second then the restore's 0.5 s left
    assert g.badput_s["restore"] == pytest.approx(0.5) and g.badput_s["detection_restart"] == 0.0
    assert g.badput_s["recomputed_steps"] == pytest.approx(3.0) and g.productive_s == pytest.approx(9.0)


def test_an_attempt_records_its_process_start_on_the_clock_of_every_other_record() -> None:
    """The overlap's cause: the process start read a second early. A real process, started after
    ``before``, must record a start after it (to a clock tick) and before its own first line."""
    code = "import time; t = time.time(); from pretrain.resilience.attempts import _process_start; "
    code += "print(t, _process_start())"
    before = time.time()
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, timeout=60)
    first_line, started = map(float, out.stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= started <= first_line + tick, (before, started, first_line)


def test_the_gap_after_a_preemption_is_waiting_not_detection() -> None:
    attempts, rows, saves = two_attempts(first_status="preempted")
    g = goodput_of(attempts, rows, saves, [])
    assert g.badput_s["preemption_wait"] == pytest.approx(9.0) and g.badput_s["detection_restart"] == 0.0


def test_an_evaluation_inside_a_step_is_evaluation_badput() -> None:
    attempts, rows, _ = two_attempts()
    g = goodput_of(attempts, rows, [], [16.5])
    assert g.badput_s["evaluation"] == pytest.approx(1.0) and g.badput_s["checkpoint"] == pytest.approx(1.0)


def _noisy_run(save_every: int, save_adds: float) -> tuple[list, list, list]:
    """100 steps of 0.8, 1.0 or 1.2 s in turn (a noisy machine, the same noise for the steps with a
    save and without), a save inside every ``save_every``-th step adding ``save_adds`` s to it."""
    attempts = [{"id": "a", "attempt": 1, "status": "succeeded", "process_started_at": 0.0, "ended_at": 200.0}]
    t, rows, saves = 1.0, [], []
    for step in range(1, 101):
        step_s = (0.8, 1.0, 1.2)[step % 3] + (save_adds if step % save_every == 0 else 0.0)
        if step % save_every == 0:
            saves.append((t + 0.1, t + step_s / 2))
        t += step_s
        rows.append((step, t))
    return attempts, _rows("a", rows), saves


@pytest.mark.parametrize("save_adds", [0.0, 0.5])
def test_a_saves_cost_is_what_it_adds_to_its_step_not_the_noise_of_the_steps_it_fell_in(save_adds: float) -> None:
    """Each save step's excess over the median counted every slow step that held a save: a free
    save every 10 steps was charged 0.2 s each. The median save step minus the median plain step
    is what a save costs."""
    attempts, rows, saves = _noisy_run(10, save_adds)
    g = goodput_of(attempts, rows, saves, [])
    assert g.badput_s["checkpoint"] - (200.0 - rows[-1]["time"]) == pytest.approx(10 * save_adds, abs=1e-6)
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)


def test_a_background_saves_cost_is_counted_in_the_steps_it_overlapped_before_its_publication() -> None:
    """A tier-0 snapshot starts after step k, its writer slows step k+1, and it is published (its
    event written) after step k+1, inside step k+2's window: from start to publication it is a span."""
    attempts, rows, _ = _noisy_run(10, 0.0)
    slowed = [r["step"] for r in rows if r["step"] % 10 == 1 and r["step"] > 1]
    shift = 0.0
    for r in rows:  # the step after each save is 0.5 s slower
        shift += 0.5 if r["step"] in slowed else 0.0
        r["time"] += shift
    times = {r["step"]: r["time"] for r in rows}
    saves = [(times[k - 1] + 0.01, times[k] + 0.01) for k in slowed]  # published just after step k
    attempts[0]["ended_at"] = rows[-1]["time"] + 1.0
    g = goodput_of(attempts, rows, saves, [])
    assert g.badput_s["checkpoint"] - 1.0 == pytest.approx(0.5 * len(slowed), abs=0.3)
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)


def test_with_a_save_in_every_step_the_whole_excess_is_the_saves() -> None:
    attempts, rows, saves = _noisy_run(1, 0.0)
    g = goodput_of(attempts, rows, saves, [])
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)]
    excess = sum(max(0.0, d - statistics.median(steps)) for d in steps)
    assert excess > 5 and g.badput_s["checkpoint"] - (200.0 - rows[-1]["time"]) == pytest.approx(excess, abs=1e-6)


def _write_run(run: Path) -> None:
    attempts, rows, saves = two_attempts()
    (run / "attempts").mkdir(parents=True)
    for rec in attempts:
        (run / "attempts" / f"attempt-{rec['attempt']:02d}.json").write_text(json.dumps(rec))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [{"event": "save", "tier": "local", "seconds": 0.2, "time": t, "attempt": "a"} for _, t in saves]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_prometheus_and_status_show_the_split_read_from_the_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "runs" / "t"
    _write_run(run)
    assert goodput_from_records(run).badput_s["restore"] == 2.0
    registry = CollectorRegistry()
    registry.register(GoodputCollector(run, "t"))
    text = generate_latest(registry).decode()
    assert f'training_goodput_ratio{{run_id="t"}} {10 / 36}' in text
    assert 'training_badput_seconds_total{cause="restore",run_id="t"} 2.0' in text
    assert 'training_badput_seconds_total{cause="startup",run_id="t"} 10.0' in text
    assert main(["status", "--goodput", str(run)]) == 0
    out = capsys.readouterr().out
    assert "27.8% of 36.0 s wall was training" in out and "badput startup" in out
    assert main(["status", "--goodput", "--json", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["badput_s"]["recomputed_steps"] == 3.0


PROMQL_WORDS = {"rate", "increase", "sum", "by", "time", "max", "min", "avg", "without", "on", "irate", "clamp_min"} | {
    "histogram_quantile",
    "le",
}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\bby\s*\([^)]*\)", "", expr)  # grouping labels
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in PROMQL_WORDS}


def test_every_metric_the_dashboard_plots_is_exported_by_the_code(tmp_path: Path) -> None:
    dashboard = json.loads((REPO / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    plotted = set().union(*(_metric_names(e) for e in exprs))
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("loss", "throughput", "goodput", "checkpoint age", "restarts", "s3", "tier health") + (
        "save and restore",
        "stragglers",
    ):
        assert topic in titles, topic
    run = tmp_path / "runs" / "t"
    _write_run(run)
    metrics = TrainingMetrics("t")
    metrics.tokens_per_step = 1024
    metrics.stepped(1)
    metrics.saved("local", 0.1)
    metrics.validated(1, 2.0)
    metrics.recovered(3, 4.2)
    metrics.from_history([{"status": "failed", "failure": {"classification": "infrastructure"}}])
    metrics.registry.register(GoodputCollector(run, "t"))
    metrics.save_failed("local")
    metrics.tier_healthy("local", True)
    metrics.loaded("local", 1.0)
    metrics.straggler_score(0, "n0", 1.0)
    uploader = UploaderMetrics("t")  # the uploader Deployment's own series (S3 panels)
    uploader.pending.labels("t").set(0)  # set by each promotion round
    exported = {s.name for reg in (metrics.registry, uploader.registry) for m in reg.collect() for s in m.samples}
    assert plotted and plotted <= exported, plotted - exported
