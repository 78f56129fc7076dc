"""Goodput from a run's own records: how much of the wall time became training, and where the rest went.

Reads the attempt records (``attempts/attempt-NN.json``), ``metrics.jsonl`` (one row per step, with
its attempt and time) and the ``save`` events of ``events.jsonl``; writes nothing. The wall time
from the first attempt's process start to the last sign of life is split, with nothing left over,
into productive seconds and badput by cause:

* ``startup``: the first attempt's start-up before its first step (imports, process group, build);
* ``detection_restart``: after a failure, its last sign of life to the next attempt's first step,
  restore and that step's own time excluded (the launcher's detection and teardown, the new
  processes' start-up and rendezvous);
* ``preemption_wait``: the same gap after a preempted attempt (the scheduler's requeue included);
* ``restore``: the restore of each attempt that restored (its recorded seconds);
* ``recomputed_steps``: steps an earlier attempt had already finished, trained again;
* ``checkpoint``: the time a step took beyond the run's median step when a save fell inside it
  (blocked time plus step excess), and the end of a finished attempt after its last step (final save);
* ``evaluation``: the same excess when an evaluation fell inside it.

A step's own time is the gap between its row and the row before it in the same attempt (an
attempt's first step counts the median). Excess without a save or an evaluation inside it is noise
of the machine, counted as productive. ``pretrain status --goodput``, ``pretrain soak``, ``pretrain
drill`` print it; :class:`GoodputCollector` exports it to Prometheus from rank 0's metrics server.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pretrain.observability.runlog import read_jsonl
from pretrain.resilience.attempts import read_attempts

CAUSES = (
    "startup",
    "detection_restart",
    "preemption_wait",
    "restore",
    "recomputed_steps",
    "checkpoint",
    "evaluation",
)


@dataclass
class Goodput:
    wall_s: float = 0.0
    productive_s: float = 0.0
    badput_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    steps: int = 0  # distinct steps trained
    steps_run: int = 0  # steps run, recomputed ones included
    attempts: int = 0

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "goodput_ratio": round(self.ratio, 4),
            "badput_s": {k: round(v, 3) for k, v in self.badput_s.items()},
            "steps": self.steps,
            "steps_run": self.steps_run,
            "attempts": self.attempts,
        }


def _start(rec: dict[str, Any]) -> float | None:
    for key in ("process_started_at", "started_at"):
        if rec.get(key) is not None:
            return float(rec[key])
    return None


def _within(times: list[float], lo: float, hi: float) -> bool:
    return any(lo < t <= hi for t in times)


def goodput_of(
    attempts: list[dict[str, Any]], rows: list[dict[str, Any]], saves: list[float], evals: list[float]
) -> Goodput:
    """The split (see the module docstring) of records already read; pure."""
    g = Goodput()
    attempts = [a for a in attempts if _start(a) is not None and a.get("status") != "unreadable"]
    train = sorted((r for r in rows if r.get("kind") != "validation"), key=lambda r: r["time"])
    if not attempts or not train:
        return g
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for r in train:
        by_attempt.setdefault(r["attempt"], []).append(r)
    deltas = [b["time"] - a["time"] for rs in by_attempt.values() for a, b in zip(rs, rs[1:], strict=False)]
    median = statistics.median(deltas) if deltas else 0.0
    attempts.sort(key=lambda a: _start(a) or 0.0)
    reached = 0  # the furthest step finished before the attempt at hand
    prev_end: float | None = None
    prev_status = None
    begin = _start(attempts[0]) or 0.0
    end = begin
    for rec in attempts:
        start = _start(rec) or 0.0
        mine = by_attempt.get(rec.get("id", ""), [])
        gap_cause = "preemption_wait" if prev_status == "preempted" else "detection_restart"
        if prev_end is not None and start > prev_end:
            g.badput_s[gap_cause] += start - prev_end
        if not mine:  # died before its first step: everything it ran was recovery
            stop = max(rec.get("ended_at") or start, start)
            g.badput_s["startup" if prev_end is None else gap_cause] += stop - start
            prev_end, prev_status, end = stop, rec.get("status"), max(end, stop)
            continue
        restore = float((rec.get("restored") or {}).get("seconds") or 0.0)
        first = mine[0]
        lead = max(0.0, first["time"] - start - restore - median)
        g.badput_s["restore"] += restore
        g.badput_s["startup" if prev_end is None else gap_cause] += lead
        _step(g, first["step"], min(median, first["time"] - start), reached)
        for a, b in zip(mine, mine[1:], strict=False):
            d = b["time"] - a["time"]
            base, excess = min(d, median), max(0.0, d - median)
            _step(g, b["step"], base, reached)
            if _within(saves, a["time"], b["time"]):
                g.badput_s["checkpoint"] += excess
            elif _within(evals, a["time"], b["time"]):
                g.badput_s["evaluation"] += excess
            else:
                g.productive_s += excess  # the machine's noise: still training
        last = mine[-1]["time"]
        stop = max(rec.get("ended_at") or last, last)
        tail = {"succeeded": "checkpoint", "preempted": "preemption_wait"}.get(rec.get("status", ""), gap_cause)
        g.badput_s[tail] += stop - last
        reached = max(reached, max(r["step"] for r in mine))
        prev_end, prev_status, end = stop, rec.get("status"), max(end, stop)
    g.wall_s = end - begin
    g.steps = len({r["step"] for r in train})
    g.steps_run = len(train)
    g.attempts = len(attempts)
    return g


def _step(g: Goodput, step: int, seconds: float, reached: int) -> None:
    if step <= reached:
        g.badput_s["recomputed_steps"] += seconds
    else:
        g.productive_s += seconds


def goodput_from_records(run_dir: Path, until: float | None = None) -> Goodput:
    """Goodput of the run in ``run_dir`` (``<run.dir>/<run.id>``) from its records (``until``: only
    the attempts that started before that time, and their rows)."""
    events = read_jsonl(run_dir / "events.jsonl")
    saves = [float(e["time"]) for e in events if e.get("event") == "save"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [float(r["time"]) for r in rows if r.get("kind") == "validation"]
    attempts = read_attempts(run_dir)
    if until is not None:
        attempts = [a for a in attempts if (_start(a) or 0.0) <= until]
        rows = [r for r in rows if r["time"] <= until]
    return goodput_of(attempts, rows, saves, evals)


def format_goodput(g: Goodput, title: str = "goodput") -> str:
    lines = [
        f"{title}: {g.ratio:.1%} of {g.wall_s:.1f} s wall was training ({g.productive_s:.1f} s; "
        f"{g.steps} steps, {g.steps_run} run, {g.attempts} attempts)"
    ]
    for cause, secs in sorted(g.badput_s.items(), key=lambda kv: -kv[1]):
        share = secs / g.wall_s if g.wall_s > 0 else 0.0
        lines.append(f"  badput {cause:<18} {secs:8.2f} s  {share:6.1%}")
    return "\n".join(lines)


class GoodputCollector(Collector):
    """``training_goodput_ratio`` and ``training_badput_seconds_total{cause}``, computed from the
    run's records at every scrape (a few reads of files rank 0 already writes)."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = run_dir
        self.run_id = run_id

    def collect(self) -> Iterable[Metric]:
        g = goodput_from_records(self.run_dir)
        ratio = GaugeMetricFamily(
            "training_goodput_ratio", "Share of the run's wall time that trained new steps", labels=["run_id"]
        )
        ratio.add_metric([self.run_id], g.ratio)
        bad = CounterMetricFamily(
            "training_badput_seconds", "Wall seconds of the run that did not train new steps, by cause",
            labels=["run_id", "cause"],
        )  # fmt: skip
        for cause in CAUSES:
            bad.add_metric([self.run_id, cause], g.badput_s[cause])
        productive = CounterMetricFamily(
            "training_productive_seconds", "Wall seconds of the run that trained new steps", labels=["run_id"]
        )
        productive.add_metric([self.run_id], g.productive_s)
        return [ratio, bad, productive]
