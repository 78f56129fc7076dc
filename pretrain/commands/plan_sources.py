"""Where ``pretrain plan`` takes its measured figures: a run's own records, or ``make bench``'s results.

A figure carries its value and where it came from, which the plan prints beside it.

* A run (``--run-dir <run.dir>/<run.id>``): the step time is the median step of ``metrics.jsonl``
  (consecutive steps of one attempt, past each attempt's first two); a save's cost per tier is its
  step excess, the step after a save minus a plain step (a step after no save of any tier), never
  less than the median ``blocked_seconds`` of the tier's ``save`` events in ``events.jsonl``; a
  restore's cost per tier is the median ``restored.seconds`` of the attempt records
  (``attempts/attempt-NN.json``).
* The bench (``--bench-results``, default the repository's ``bench/results``): the newest results
  file with save-cost rows (``bench/save_cost.py``: tier 1 in the config's writer mode, tier 0),
  the I/O rows' cold restore (tier 1) and peer restore (replica), and ``tier0-*.json``'s restore,
  each from the measured size nearest the rank's state and scaled to it by bytes (a 2-CPU bench
  machine: a run on the target cluster measures better).

Never: measures anything itself or guesses a figure it has no record of (a missing figure is
absent, and the plan says what to pass). Called by :mod:`pretrain.commands.plan_command`;
:func:`save_costs` is also the bench's own step-excess arithmetic (bench/save_cost.py).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.resilience.attempts import read_attempts

WARMUP_STEPS = 2  # each attempt's first steps: start-up, not training


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # said beside the value in the plan


@dataclass
class MeasuredCosts:
    step_s: Figure | None = None
    save: dict[str, Figure] = field(default_factory=dict)  # tier -> seconds one save costs training
    restore: dict[str, Figure] = field(default_factory=dict)  # tier -> seconds to restore

    def merged_over(self, other: MeasuredCosts) -> MeasuredCosts:
        """These figures, with ``other``'s where these have none."""
        return MeasuredCosts(
            self.step_s or other.step_s, {**other.save, **self.save}, {**other.restore, **self.restore}
        )


@dataclass(frozen=True)
class SaveCost:
    blocked_s: float  # median seconds the training thread waited
    step_excess_s: float  # median (step after a save - plain step)
    plain_step_s: float
    saves: int

    @property
    def cost_s(self) -> float:
        return max(self.blocked_s, self.step_excess_s)


def step_durations(rows: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(attempt, step) -> seconds since the step before in the same attempt, past the warm-up."""
    times = {(r.get("attempt", ""), r["step"]): r["time"] for r in rows if r.get("kind") is None and "time" in r}
    first: dict[str, int] = {}
    for attempt, step in times:
        first[attempt] = min(first.get(attempt, step), step)
    return {
        (a, s): t - times[(a, s - 1)]
        for (a, s), t in times.items()
        if (a, s - 1) in times and s - first[a] >= WARMUP_STEPS
    }


def save_costs(rows: list[dict[str, Any]], saves: list[dict[str, Any]]) -> dict[str, SaveCost]:
    """Per tier: blocked time and step excess of its saves (``save`` events) against plain steps.

    A step after saves of several tiers counts for each only when no other tier saved there; a tier
    that never saved alone falls back to the shared steps."""
    durations = step_durations(rows)
    by_step: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in saves:
        by_step[(e.get("attempt", ""), e["step"])].add(e["tier"])
    plain = [d for (a, s), d in durations.items() if (a, s - 1) not in by_step]
    out: dict[str, SaveCost] = {}
    for tier in sorted({e["tier"] for e in saves}):
        mine = [e for e in saves if e["tier"] == tier]
        after = [(k, by_step[k]) for k in {(e.get("attempt", ""), e["step"]) for e in mine}]
        alone = [durations.get((a, s + 1)) for (a, s), tiers in after if tiers == {tier}]
        shared = [durations.get((a, s + 1)) for (a, s), _ in after]
        following = [d for d in alone if d is not None] or [d for d in shared if d is not None]
        if not plain or not following:
            continue
        base = statistics.median(plain)
        out[tier] = SaveCost(
            statistics.median(e["blocked_seconds"] for e in mine),
            statistics.median(d - base for d in following),
            base,
            len(mine),
        )
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """A run's JSON-lines records; a torn last line (a rank killed mid-write) is left out, any other
    line that is not JSON is a ValueError naming the file and line."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if n == len(lines):
                break  # torn by a kill: the records before it stand
            raise ValueError(f"{path}:{n}: not a JSON record ({exc.msg}); fix: pass an intact run directory") from None
    return out


def costs_from_run(run_dir: Path) -> MeasuredCosts:
    """The step time, save costs and restore costs a run recorded (what it has; nothing invented)."""
    rows = _jsonl(run_dir / "metrics.jsonl")
    events = _jsonl(run_dir / "events.jsonl")
    out = MeasuredCosts()
    durations = step_durations(rows)
    where = str(run_dir)
    saves = [e for e in events if e.get("event") == "save"]
    by_step = {(e.get("attempt", ""), e["step"]) for e in saves}
    plain = [d for (a, s), d in durations.items() if (a, s - 1) not in by_step]
    if plain:
        out.step_s = Figure(statistics.median(plain), f"{where}/metrics.jsonl: median of {len(plain)} plain steps")
    for tier, cost in save_costs(rows, saves).items():
        out.save[tier] = Figure(
            cost.cost_s,
            f"{where}: step excess {cost.step_excess_s:.3f} s, blocked {cost.blocked_s:.3f} s "
            f"(medians of {cost.saves} saves)",
        )
    restores: dict[str, list[float]] = defaultdict(list)
    for rec in read_attempts(run_dir):
        r = rec.get("restored") or {}
        if r.get("tier") and r.get("seconds") is not None:
            restores[r["tier"]].append(float(r["seconds"]))
    for tier, secs in restores.items():
        out.restore[tier] = Figure(
            statistics.median(secs), f"{where}/attempts: median of {len(secs)} restore(s) from {tier}"
        )
    return out


def _nearest(rows: list[dict[str, Any]], state_bytes: float, size_key: str = "size_mb") -> dict[str, Any]:
    return min(rows, key=lambda r: abs(math.log(r[size_key] * 1e6 / state_bytes)))


def _scaled(seconds: float, measured_mb: float, state_bytes: float, what: str, path: Path) -> Figure:
    scale = state_bytes / (measured_mb * 1e6)
    return Figure(seconds * scale, f"{path}: {what}, {seconds:.3f} s at {measured_mb:.0f} MB x{scale:.3g} by bytes")


def _machine(data: dict[str, Any]) -> str:
    """What the bench ran on, said beside its figures (a 2-CPU VM's seconds are not an H100 node's)."""
    if data.get("machine"):
        return f"; bench machine: {data['machine']}"
    return f"; bench machine: {data['cpus']} CPUs" if data.get("cpus") else ""


def _date(name: str) -> str:
    found = re.search(r"\d{4}-\d{2}-\d{2}", name)
    return found.group(0) if found else ""


def _results(results_dir: Path, prefix: str = "") -> list[tuple[Path, dict[str, Any]]]:
    """Results files, newest first (their names start with the date)."""
    out = []
    paths = sorted(results_dir.glob(f"{prefix}*.json"), key=lambda p: (_date(p.name), p.name), reverse=True)
    for path in paths:
        try:
            out.append((path, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, json.JSONDecodeError):
            continue  # a results file being written or foreign: not a figure
    return out


def _bench_save_costs(row: dict[str, Any], mode: str, state_bytes: float, path: Path) -> dict[str, Figure]:
    """Tier 1 (``mode``) and tier 0 from a results row with ``save_cost`` (repeated jobs); an older
    row has one job's tier-1 medians (blocked and step excess) only."""
    cases = (row.get("save_cost") or {}).get("cases")
    mb = row["state_mb"]
    if not cases:
        cost = max(row[f"blocked_{mode}_s"], row.get(f"step_excess_{mode}_s") or 0.0)
        return {"local": _scaled(cost, mb, state_bytes, f"tier-1 {mode} step excess/blocked, one job", path)}
    out = {}
    for tier, case in (("local", f"tier1-{mode}"), ("memory", "tier0")):
        if case in cases:
            what = f"{case} step excess/blocked, median of {cases[case]['repeats']} jobs"
            out[tier] = _scaled(cases[case]["cost_s"]["median"], mb, state_bytes, what, path)
    return out


def costs_from_bench(results_dir: Path, state_bytes: float, mode: str) -> MeasuredCosts:
    """Save and restore costs from the bench results, scaled to ``state_bytes`` per rank;
    ``mode``: the tier-1 writer mode (``thread`` or ``fork``) whose save cost applies."""
    out = MeasuredCosts()
    dated = [(p, d) for p, d in _results(results_dir) if p.name[:1].isdigit()]
    with_cost = [(p, d) for p, d in dated if any(f"blocked_{mode}_s" in b for b in d.get("blocked", []))]
    if with_cost:
        path, data = with_cost[0]
        row = _nearest([b for b in data["blocked"] if f"blocked_{mode}_s" in b], state_bytes, "state_mb")
        for tier, fig in _bench_save_costs(row, mode, state_bytes, path).items():
            out.save[tier] = Figure(fig.value, fig.source + _machine(data))
    with_io = [(p, d) for p, d in dated if d.get("io")]
    if with_io:
        path, data = with_io[0]
        row = _nearest(data["io"], state_bytes)
        for tier, key, what in (
            ("local", "restore_cold", "verified cold restore"),
            ("replica", "peer_restore", "peer restore"),
        ):
            fig = _scaled(row[key]["measured_s"], row["size_mb"], state_bytes, what, path)
            out.restore[tier] = Figure(fig.value, fig.source + _machine(data))
    tier0 = [(p, d) for p, d in _results(results_dir, "tier0-") if d.get("tier0")]
    if tier0:
        path, data = tier0[0]
        row = _nearest(data["tier0"], state_bytes)
        fig = _scaled(
            row["restore_vs_raw_read"]["measured_s"], row["size_mb"], state_bytes, "tier-0 verify + map", path
        )
        out.restore["memory"] = Figure(fig.value, fig.source + _machine(data))
    return out
