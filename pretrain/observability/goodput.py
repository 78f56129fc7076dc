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
* ``checkpoint``: what a save adds to the steps it overlaps, from its start to its publication
  (blocked time plus step excess: the mean step overlapped by a save minus the mean plain step,
  see :func:`_step_cost`), and the end of a finished attempt after its last step (final save);
* ``evaluation``: the same for an evaluation.

A step's own time is the gap between its row and the row before it in the same attempt (an
attempt's first step counts a plain step). Excess beyond what a save or an evaluation adds is noise
of the machine, counted with its step (productive, or recomputed).

The split is a partition by construction: the records are read as one timeline from the first
process start to the last sign of life and each second is handed out once, in order, so records
that overlap count once. They can: ``process_started_at`` was psutil's ``create_time``, which reads
up to a second early (``/proc/stat`` truncates the boot time it adds to whole seconds), and a
launcher restarting within that second made an attempt start before the previous one ended (the
parts summed to 0.4 s more than the wall time). ``pretrain status --goodput``, ``pretrain soak``
and ``pretrain drill`` print it; :class:`GoodputCollector` exports it to Prometheus from rank 0's metrics server.
"""

from __future__ import annotations

import bisect
import itertools
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

Span = tuple[float, float]  # (start, end) wall times

# Plain steps (no save, no evaluation) needed to tell a save's cost from the machine's noise.
MIN_PLAIN_STEPS = 5
MIN_PLAIN_SHARE = 0.2

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


class _Marks:
    """What fell inside a step's window ``(lo, hi]``: a save (``checkpoint``) overlapping it, else an
    evaluation ending in it, else nothing. Built once per run and asked per step in O(log n): the
    Prometheus collector splits the whole run at every scrape, and a run with a save every step has
    as many saves as steps."""

    def __init__(self, saves: list[Span], evals: list[float]) -> None:
        spans = sorted(saves)
        self._starts = [start for start, _ in spans]
        self._latest_end = list(itertools.accumulate((end for _, end in spans), max))  # of the spans so far
        self._evals = sorted(evals)

    def at(self, lo: float, hi: float) -> str | None:
        begun = bisect.bisect_left(self._starts, hi)  # the spans that start before hi
        if begun and self._latest_end[begun - 1] > lo:
            return "checkpoint"
        if bisect.bisect_right(self._evals, hi) > bisect.bisect_right(self._evals, lo):
            return "evaluation"
        return None


class _Timeline:
    """The run's wall time handed out once, in order: each ``take`` gives the seconds from where the
    last one stopped up to ``until`` to one cause, so the parts partition the wall time whatever the
    records say. Records can overlap: an attempt's ``process_started_at`` (the kernel's process start)
    may fall before the previous attempt's ``ended_at`` (its rank 0's clock) when the launcher
    restarts within a second; an overlap is given once, to whichever came first."""

    def __init__(self, g: Goodput, begin: float) -> None:
        self.g = g
        self.at = begin

    def take(self, cause: str | None, until: float) -> float:
        """Give ``[at, until]`` to ``cause`` (None: productive); returns the seconds given."""
        secs = max(0.0, until - self.at)
        if cause is None:
            self.g.productive_s += secs
        else:
            self.g.badput_s[cause] += secs
        self.at = max(self.at, until)
        return secs

    def take_for(self, cause: str | None, seconds: float, limit: float) -> None:
        """Give the next ``seconds`` (at most up to ``limit``) to ``cause``."""
        self.take(cause, min(self.at + max(0.0, seconds), limit))


def goodput_of(
    attempts: list[dict[str, Any]], rows: list[dict[str, Any]], saves: list[Span], evals: list[float]
) -> Goodput:
    """The split (see the module docstring) of records already read; pure. ``saves``: each save
    from its start to its publication (a background save spans the steps its writer overlapped);
    ``evals``: the end of each evaluation."""
    g = Goodput()
    attempts = [a for a in attempts if _start(a) is not None and a.get("status") != "unreadable"]
    train = sorted((r for r in rows if r.get("kind") != "validation"), key=lambda r: r["time"])
    if not attempts or not train:
        return g
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for r in train:
        by_attempt.setdefault(r["attempt"], []).append(r)
    marks = _Marks(saves, evals)
    step_cost = _step_cost(by_attempt, marks)
    attempts.sort(key=lambda a: _start(a) or 0.0)
    begin = _start(attempts[0]) or 0.0
    line = _Timeline(g, begin)
    reached = 0  # the furthest step finished before the attempt at hand
    prev_status: str | None = None
    for n, rec in enumerate(attempts):
        gap_cause = "preemption_wait" if prev_status == "preempted" else "detection_restart"
        recovery = "startup" if n == 0 else gap_cause
        line.take(gap_cause, _start(rec) or 0.0)  # the previous attempt's end to this one's process start
        mine = by_attempt.get(rec.get("id", ""), [])
        if mine:
            _attempt_steps(line, rec, mine, step_cost, reached, recovery, marks)
            reached = max(reached, max(r["step"] for r in mine))
            tail = {"succeeded": "checkpoint", "preempted": "preemption_wait"}.get(rec.get("status", ""), gap_cause)
        else:
            tail = recovery  # died before its first step: everything it ran was recovery
        line.take(tail, rec.get("ended_at") or 0.0)
        prev_status = rec.get("status")
    g.wall_s = line.at - begin
    g.steps = len({r["step"] for r in train})
    g.steps_run = len(train)
    g.attempts = len(attempts)
    return g


@dataclass(frozen=True)
class _StepCost:
    """A plain step's time, and what a save or an evaluation inside a step adds to it."""

    plain: float
    save: float | None  # None: too few plain steps to tell (a save every step or two): the whole excess
    evaluation: float | None


def _step_cost(by_attempt: dict[str, list[dict[str, Any]]], marks: _Marks) -> _StepCost:
    """What a step overlapped by a save (or holding an evaluation) takes beyond a plain step: the
    mean of the one minus the mean of the other. The noise of the machine is in both and cancels
    (a trimmed mean would drop the saves' costliest steps: the fork, the copy-on-write faults).

    Not each overlapped step's excess over the median: that is the noise of every step that held a
    save. On 1,000 steps of the tiny config (2 ranks, 2 cores), tier 1 every 10 steps and the
    reshardable tier every 20 cost 21.5-29.7 s against a run without them (its final save counted);
    that way charged 2.4-3.7 s, this way 18.3-19.2 s (with tier 0 every 5 steps too: 23.3-31.2 s
    cost, 4.4-5.8 s against 22.9-25.6 s charged). With fewer than ``MIN_PLAIN_SHARE``
    of the steps plain (a save every step or two) the two cannot be told apart from one run: the
    whole excess over the median is charged, and a save's constant part, in every step alike, is
    missed (compare with a run without it: ``pretrain soak`` arms)."""
    windows: dict[str | None, list[float]] = {"checkpoint": [], "evaluation": [], None: []}
    for rs in by_attempt.values():
        for a, b in zip(rs, rs[1:], strict=False):
            windows[marks.at(a["time"], b["time"])].append(b["time"] - a["time"])
    every = [d for ds in windows.values() for d in ds]
    if len(windows[None]) < max(MIN_PLAIN_STEPS, MIN_PLAIN_SHARE * len(every)):
        return _StepCost(statistics.median(every) if every else 0.0, None, None)
    plain = statistics.fmean(windows[None])

    def added(kind: str) -> float | None:
        return max(0.0, statistics.fmean(windows[kind]) - plain) if windows[kind] else None

    return _StepCost(statistics.median(windows[None]), added("checkpoint"), added("evaluation"))


def _attempt_steps(
    line: _Timeline,
    rec: dict[str, Any],
    mine: list[dict[str, Any]],
    cost: _StepCost,
    reached: int,
    recovery: str,
    marks: _Marks,
) -> None:
    """One attempt from its process start to its last step: start-up or restart, restore, the first
    step (a plain step at most), then each step: a plain step's time, then what a save or an
    evaluation inside it adds (see :func:`_step_cost`), the rest productive (the machine's noise)."""
    median = cost.plain
    first = mine[0]
    restore = float((rec.get("restored") or {}).get("seconds") or 0.0)
    # the first step's window: start-up, then the restore, then the step itself (restore and step
    # are what come last before the row; start-up gets what is left, never a negative share)
    window = max(0.0, first["time"] - line.at)
    step_s = min(median, window)
    restore_s = min(restore, window - step_s)
    line.take_for(recovery, window - step_s - restore_s, first["time"])
    line.take_for("restore", restore_s, first["time"])
    line.take("recomputed_steps" if first["step"] <= reached else None, first["time"])
    for a, b in zip(mine, mine[1:], strict=False):
        step_cause = "recomputed_steps" if b["step"] <= reached else None
        mark = marks.at(a["time"], b["time"])
        added = cost.save if mark == "checkpoint" else cost.evaluation
        if mark is not None and added is not None:  # first, so a step faster than usual still pays it
            line.take_for(mark, added, b["time"])
        line.take_for(step_cause, median, b["time"])
        if mark is not None and added is None:
            line.take(mark, b["time"])
        line.take(step_cause, b["time"])  # the machine's noise: still training (or training again)


def goodput_from_records(run_dir: Path, until: float | None = None) -> Goodput:
    """Goodput of the run in ``run_dir`` (``<run.dir>/<run.id>``) from its records (``until``: only
    the attempts that started before that time, and their rows)."""
    events = read_jsonl(run_dir / "events.jsonl")
    done = [e for e in events if e.get("event") == "save"]  # each from its start to its publication
    saves = [(float(e["time"]) - float(e.get("seconds") or 0.0), float(e["time"])) for e in done]
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
