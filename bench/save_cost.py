"""What a save costs training, in the real trainer: blocked seconds and step excess, per tier and mode.

The blocked time (``blocked_seconds`` of a save event) is only the part the training thread waits
for. The step excess is what training loses: the step after a save (it holds the blocked time,
the copy-on-write faults or the wait for the snapshot before the optimizer step, and the writer's
competition for the cores) minus a plain step of the same job. A save's cost is the larger of the
two (the excess is never below the blocked time except by noise).

Cases, each a 2-rank ``pretrain train`` job saving every ``SAVE_EVERY`` steps:

* ``tier1-thread`` and ``tier1-fork``: the tier-1 background save (``checkpoint.async.mode``);
* ``tier0``: the tier-0 slot write into a tmpfs (its writer is always a thread: there is no fork
  mode), tier 1 saving only the final step;
* ``tier1-agent``: tier 1 through the node's checkpoint agent (tier 0 snapshots the steps tier 1
  is due for, the agent process persists them): the cost is read off the tier-1 saves.

The cases run ``repeats`` times in rotating order, so that drifting machine load hits each alike;
every figure is the median over repeats with the spread (min-max) of the per-job medians.
:func:`default_mode` picks the tier-1 mode with the smaller median cost, or none when the two
modes' spreads overlap (the choice would be this machine's noise, and the default stays).

Never: starts the jobs itself (the caller's :class:`TrainJob` does: bench.suite's ``_train``),
or writes results (bench.suite does).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.commands.plan_sources import save_costs, step_durations

SAVE_EVERY = 3  # steps between saves in the save-cost jobs
SLOTS = 2  # tier-0 slots per rank (the config default)
RANKS = 2

# (settings of the job) per case; tier 1's final-step save is excluded from the figures.
CASES: dict[str, list[str]] = {
    "tier1-thread": ["checkpoint.async.mode=thread", f"checkpoint.local.interval={SAVE_EVERY}"],
    "tier1-fork": ["checkpoint.async.mode=fork", f"checkpoint.local.interval={SAVE_EVERY}"],
    "tier0": [
        "checkpoint.memory.enabled=true",
        f"checkpoint.memory.interval={SAVE_EVERY}",
        f"checkpoint.memory.slots={SLOTS}",
        "checkpoint.local.interval=100000",
    ],
}
# Tier 1 through the node's checkpoint agent: tier 0 snapshots the steps tier 1 is due for and the
# agent persists them; what training pays is tier 0's snapshot plus the agent's competition for
# the cores (its cost is read off the tier-1 saves, whose steps hold both).
CASES["tier1-agent"] = [
    "checkpoint.memory.enabled=true",
    f"checkpoint.memory.interval={SAVE_EVERY}",
    "checkpoint.memory.slots=3",
    "checkpoint.agent.enabled=true",
    f"checkpoint.local.interval={SAVE_EVERY}",
]
TIER_OF_CASE = {"tier1-thread": "local", "tier1-fork": "local", "tier0": "memory", "tier1-agent": "local"}
TIER0_CASES = ("tier0", "tier1-agent")  # the cases that need tmpfs for their slots

# One 2-rank training job: (job directory, name, --set settings) -> its events, the metrics rows
# last as {"event": "metrics", "rows": [...], "ckpt": dir}.
TrainJob = Callable[[Path, str, list[str]], list[dict[str, Any]]]


def job_save_cost(events: list[dict[str, Any]], tier: str, last_step: int) -> dict[str, float] | None:
    """Median blocked seconds and step excess per save of ``tier`` in one job, its plain step and
    its mean step (:func:`pretrain.commands.plan_sources.save_costs`: the planner's own arithmetic;
    the final step's save, with no step after it, is left out)."""
    rows = events[-1]["rows"]
    saves = [e for e in events if e["event"] == "save" and e["step"] != last_step]
    cost = save_costs(rows, saves).get(tier)
    if cost is None:
        return None
    return {
        "blocked_s": cost.blocked_s,
        "step_excess_s": cost.step_excess_s,
        "cost_s": cost.cost_s,
        "plain_step_s": cost.plain_step_s,
        "mean_step_s": statistics.mean(step_durations(rows).values()),
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), 4),
        "spread": [round(min(values), 4), round(max(values), 4)],
    }


def summarise(per_job: list[dict[str, float]]) -> dict[str, Any]:
    """Median and spread over repeats of each figure; cost / plain step as a fraction."""
    out: dict[str, Any] = {"repeats": len(per_job)}
    for key in ("blocked_s", "step_excess_s", "cost_s", "plain_step_s", "mean_step_s"):
        out[key] = _spread([j[key] for j in per_job])
    out["cost_per_step"] = _spread([j["cost_s"] / j["plain_step_s"] for j in per_job])
    return out


def default_mode(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tier-1 writer mode with the smaller median cost per save, when the two modes' cost
    spreads do not overlap; ``mode`` is None when they do (this run cannot tell them apart, and
    the default is not changed on noise), ``smaller_median`` says which one it leaned to."""
    thread, fork = cases.get("tier1-thread"), cases.get("tier1-fork")
    if not thread or not fork:
        return {"mode": None, "why": "a tier-1 mode was not measured"}
    best = "thread" if thread["cost_s"]["median"] <= fork["cost_s"]["median"] else "fork"
    (t_lo, t_hi), (f_lo, f_hi) = thread["cost_s"]["spread"], fork["cost_s"]["spread"]
    overlap = t_lo <= f_hi and f_lo <= t_hi
    return {
        "mode": None if overlap else best,
        "smaller_median": best,
        "thread_cost_s": thread["cost_s"]["median"],
        "fork_cost_s": fork["cost_s"]["median"],
        "within_noise": overlap,
    }


def tmpfs_fits(state_mb: int, margin: float = 1.5) -> tuple[bool, str]:
    """Whether ``RANKS x SLOTS`` tier-0 slots of ``state_mb`` and the ranks' own copies fit in
    the memory available now (MemAvailable), with ``margin``; the reason when they do not."""
    need = state_mb * 1e6 * RANKS * (SLOTS + 2) * margin  # slots + each rank's model/optimizer + a load copy
    avail = _mem_available()
    if avail is not None and avail < need:
        return False, f"needs ~{need / 1e9:.1f} GB of memory, {avail / 1e9:.1f} GB available"
    return True, ""


def _mem_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _keep_one_state(ckpt: Path, keep: Path) -> None:
    """The first tier-1 state file a job wrote, kept at ``keep`` (the synchronous-save baseline)."""
    if keep.exists():
        return
    state = next(ckpt.glob("*/ranks/rank-00000/steps/step-*/state.pt"), None)
    if state is not None:
        shutil.move(state, keep)


def measure_save_cost(
    train: TrainJob, work: Path, mb: int, model: list[str], steps: int, repeats: int
) -> dict[str, Any]:
    """Every case of :data:`CASES` ``repeats`` times, in rotating order, for a ``mb`` MB state;
    one rank-0 tier-1 state file of the first job is left at ``work/state.pt``."""
    cases = dict(CASES)
    skipped: dict[str, str] = {}
    fits, why = tmpfs_fits(mb)
    if not fits:
        for name in TIER0_CASES:
            skipped[name] = why
            del cases[name]
    names = list(cases)
    per_job: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    shm = Path(tempfile.mkdtemp(prefix="rp-bench-tier0-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                settings = [*model, f"train.steps={steps}", "checkpoint.local.keep=1", *cases[name]]
                if name in TIER0_CASES:
                    settings.append(f"checkpoint.memory.dir={shm / str(rep)}")
                events = train(work, f"{name}-{rep}", settings)
                cost = job_save_cost(events, TIER_OF_CASE[name], steps)
                if cost is not None:
                    per_job[name].append(cost)
                _keep_one_state(Path(events[-1]["ckpt"]), work / "state.pt")
                shutil.rmtree(work / f"{name}-{rep}", ignore_errors=True)  # GBs per job: not kept
                shutil.rmtree(shm / str(rep), ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    summary = {name: summarise(jobs) for name, jobs in per_job.items() if jobs}
    return {
        "size_mb": mb,
        "steps": steps,
        "save_every": SAVE_EVERY,
        "machine_load": round(os.getloadavg()[0], 1),
        "cases": summary,
        "skipped": skipped,
        "default_mode": default_mode(summary),
        "agent_over_in_process": agent_ratio(per_job),
    }


def agent_ratio(per_job: dict[str, list[dict[str, float]]]) -> dict[str, Any] | None:
    """Step excess per save through the agent / in the rank (the better tier-1 writer mode), per
    repeat (the cases of one repeat ran back to back), with its median and spread."""
    agent = per_job.get("tier1-agent", [])
    modes = [per_job.get(m, []) for m in ("tier1-thread", "tier1-fork")]
    ratios = []
    for i, a in enumerate(agent):
        own = [m[i]["step_excess_s"] for m in modes if i < len(m)]
        if own and min(own) > 0:
            ratios.append(a["step_excess_s"] / min(own))
    return _spread(ratios) if ratios else None
