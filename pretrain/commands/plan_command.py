"""``pretrain plan``'s arguments and run: which figures the plan uses, from where, and the printout.

Figures, first found wins: a ``--tier NAME:SAVE:RESTORE`` typed by hand, a run's records
(``--run-dir``), ``make bench``'s results (``--bench-results``); the model's parameter count and
each rank's state come from ``--config`` (:mod:`pretrain.commands.plan_model`) for ``--nodes`` x
``--ranks-per-node`` ranks. Every figure is printed with where it came from.

Never: computes intervals, goodput or capacity itself (:mod:`pretrain.commands.plan`), or reads
records other than through :mod:`pretrain.commands.plan_sources`. Called by :mod:`pretrain.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from pretrain.checkpointing.memory_budget import host_memory_per_node
from pretrain.commands.plan import (
    CapacityPlan,
    MemoryTierPlan,
    TierPlan,
    as_dict,
    format_memory_tier,
    format_plan,
    mtbf_from_failures,
    plan_capacity,
    plan_memory_tier,
    plan_tier,
    size_text,
)
from pretrain.commands.plan_model import ModelSize, count, host_layout, model_size
from pretrain.commands.plan_sources import Figure, MeasuredCosts, costs_from_bench, costs_from_run
from pretrain.config import Config, load_config

BENCH_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
PLANNED_TIERS = ("local", "reshardable")  # tiers given a Young/Daly interval from measured figures


def add_plan_arguments(pl: argparse.ArgumentParser) -> None:
    pl.add_argument("--mtbf-hours", type=float, help="the job's mean time between failures")
    pl.add_argument(
        "--failures",
        type=int,
        help="job interruptions seen on a fleet (e.g. 466, Meta's Llama 3 pre-training: 'The Llama 3 Herd of "
        "Models', 2024) ...",
    )
    pl.add_argument("--days", type=float, help="... over this many days (e.g. 54, the same record) ...")
    pl.add_argument("--cluster-gpus", type=int, help="... on this many GPUs (e.g. 16384 H100s, the same record)")
    pl.add_argument("--job-gpus", type=int, help="GPUs this job uses")
    pl.add_argument(
        "--tier", action="append", metavar="NAME:SAVE_S:RESTORE_S", help="measured blocked save and restore seconds"
    )
    pl.add_argument("--step-seconds", type=float, help="seconds per training step (intervals in steps)")
    pl.add_argument("--restart-seconds", type=float, default=60.0, help="detection + restart, before the restore")
    pl.add_argument("--params", type=float, help="model parameters, for the capacity estimate (or --config)")
    pl.add_argument("--config", help="derive parameters and per-rank state from this config's model and layout")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--ranks-per-node", type=int, default=8, help="ranks (GPUs) per node, with --config")
    pl.add_argument("--run-dir", help="<run.dir>/<run.id> of a run: step time, save and restore costs it recorded")
    pl.add_argument(
        "--bench-results", default=str(BENCH_RESULTS), help="make bench's results (save/restore costs, scaled by bytes)"
    )
    pl.add_argument("--budget", type=float, default=0.02, help="tier 0's share of the step time (0.02: 2 %%)")
    pl.add_argument("--local-keep", type=int, default=2)
    pl.add_argument("--replication", type=int, default=2)
    pl.add_argument("--staging-keep", type=int, default=2)
    pl.add_argument("--s3-keep", type=int, default=5)
    pl.add_argument(
        "--headroom", type=float, default=0.25, help="fraction added to every storage estimate (0.25: +25 %%)"
    )
    pl.add_argument("--json", action="store_true")


def _mtbf(args: argparse.Namespace) -> float | None:
    if args.mtbf_hours is not None:
        return args.mtbf_hours * 3600.0
    if args.failures is not None and args.days is not None and args.cluster_gpus and args.job_gpus:
        return mtbf_from_failures(args.failures, args.days, args.cluster_gpus, args.job_gpus)
    return None


def _typed(specs: list[str]) -> MeasuredCosts:
    """``--tier NAME:SAVE:RESTORE`` figures (ValueError names the bad one)."""
    out = MeasuredCosts()
    for spec in specs:
        try:
            name, save_text, restore_text = spec.split(":")
            save, restore = float(save_text), float(restore_text)
        except ValueError:
            raise ValueError(
                f"--tier {spec!r}: not NAME:SAVE_SECONDS:RESTORE_SECONDS; fix: e.g. local:30:240"
            ) from None
        out.save[name] = Figure(save, "--tier")
        out.restore[name] = Figure(restore, "--tier")
    return out


def _writer_mode(cfg: Config | None) -> str:
    """The tier-1 writer mode whose bench figure applies (auto is thread on the GPU hosts a plan is for)."""
    mode = cfg.checkpoint.async_.mode if cfg is not None else "auto"
    return "thread" if mode == "auto" else mode


def gather(args: argparse.Namespace, cfg: Config | None, size: ModelSize | None) -> MeasuredCosts:
    """Every figure the plan uses: typed, then the run's, then the bench's (first found wins)."""
    costs = _typed(args.tier or [])
    if args.step_seconds:
        costs.step_s = Figure(args.step_seconds, "--step-seconds")
    if args.run_dir:
        costs = costs.merged_over(costs_from_run(Path(args.run_dir)))
    if size is not None and args.bench_results and Path(args.bench_results).is_dir():
        bench = costs_from_bench(Path(args.bench_results), size.state_bytes_per_rank, _writer_mode(cfg))
        costs = costs.merged_over(bench)
    return costs


def _tiers(args: argparse.Namespace, costs: MeasuredCosts, mtbf: float) -> tuple[list[TierPlan], list[str]]:
    names = [s.split(":")[0] for s in args.tier] if args.tier else [t for t in PLANNED_TIERS if t in costs.save]
    notes = []
    if not names and not costs.save:  # no figure at all: the example row, said as such
        names, costs = ["local"], _typed(["local:1:30"]).merged_over(costs)
        notes.append("tier local: no measured save cost (--run-dir, the bench or --tier): an example row (1 s, 30 s)")
    plans = []
    step_s = costs.step_s.value if costs.step_s else None
    for name in names:
        restore = costs.restore.get(name)
        if restore is None:
            notes.append(f"tier {name}: no restore figure (a run's attempt records or --tier); not planned")
            continue
        plans.append(plan_tier(name, costs.save[name].value, restore.value, mtbf, step_s, args.restart_seconds))
    return plans, notes


def _memory_tier(args: argparse.Namespace, cfg: Config, size: ModelSize, costs: MeasuredCosts) -> MemoryTierPlan:
    save = costs.save.get("memory")
    return plan_memory_tier(
        size.state_bytes_per_rank,
        args.ranks_per_node,
        cfg.checkpoint.memory.slots,
        max(0, cfg.checkpoint.replication.factor - 1),
        save.value if save else None,
        costs.step_s.value if costs.step_s else None,
        args.budget,
    )


def _figure_lines(cfg_path: str | None, size: ModelSize | None, costs: MeasuredCosts) -> list[str]:
    lines = ["figures (and where each came from):"]
    if size is not None:
        lines.append(f"  parameters: {count(size.params)} (derived from {cfg_path}'s model section)")
        lines.append(f"  state per rank: {size_text(size.state_bytes_per_rank)} = {size.describe()}")
    if costs.step_s:
        lines.append(f"  step: {costs.step_s.value:.3f} s ({costs.step_s.source})")
    for kind, figures in (("save", costs.save), ("restore", costs.restore)):
        for tier, fig in sorted(figures.items()):
            lines.append(f"  {kind} {tier}: {fig.value:.3f} s ({fig.source})")
    return lines


def _capacity(args: argparse.Namespace, size: ModelSize | None) -> CapacityPlan | None:
    """Storage per tier: from the derived model with --config, else from --params (none without)."""
    params = float(size.params) if size is not None else args.params
    if not params:
        return None
    return plan_capacity(
        params,
        args.nodes,
        args.local_keep,
        args.replication,
        args.staging_keep,
        args.s3_keep,
        args.headroom,
        per_param=size.weight_bytes + size.optimizer_bytes if size else None,
        tier1_bytes_per_node=size.state_bytes_per_rank * args.ranks_per_node if size else None,
    )


def _host_memory_lines(cfg: Config, size: ModelSize, ranks_per_node: int) -> list[str]:
    rows = host_memory_per_node(host_layout(cfg, size, ranks_per_node, gpu=cfg.model.precision == "bf16"))
    lines = [f"host memory per node ({ranks_per_node} ranks; refused at start where the node has less):"]
    lines += [f"  {what:<58} {size_text(b):>10}" for what, b in rows]
    return lines


def run_plan(args: argparse.Namespace) -> int:
    mtbf = _mtbf(args)
    if mtbf is None:
        print(
            "pretrain plan: give --mtbf-hours or --failures/--days/--cluster-gpus/--job-gpus; fix: e.g. "
            "--failures 466 --days 54 --cluster-gpus 16384 --job-gpus 1024 (Meta's Llama 3 fleet record)",
            file=sys.stderr,
        )
        return 2
    if args.run_dir and not Path(args.run_dir).is_dir():
        print(
            f"pretrain plan: --run-dir {args.run_dir}: no such directory; fix: pass <run.dir>/<run.id>", file=sys.stderr
        )
        return 2
    cfg = load_config(args.config, args.set or []) if args.config else None
    size = model_size(cfg, args.nodes * args.ranks_per_node) if cfg is not None else None
    try:
        costs = gather(args, cfg, size)
        tiers, notes = _tiers(args, costs, mtbf)
        memory = _memory_tier(args, cfg, size, costs) if cfg is not None and size is not None else None
        capacity = _capacity(args, size)
    except ValueError as exc:  # every one names its input and its fix
        print(f"pretrain plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = as_dict(tiers, capacity, mtbf)
        out["model"] = asdict(size) if size else None
        out["memory_tier"] = asdict(memory) if memory else None
        if cfg is not None and size is not None:
            layout = host_layout(cfg, size, args.ranks_per_node, gpu=cfg.model.precision == "bf16")
            out["host_memory_per_node"] = dict(host_memory_per_node(layout))
        out["figures"] = {
            "step_s": asdict(costs.step_s) if costs.step_s else None,
            "save": {k: asdict(v) for k, v in costs.save.items()},
            "restore": {k: asdict(v) for k, v in costs.restore.items()},
        }
        print(json.dumps(out, indent=2))
        return 0
    figures = _figure_lines(args.config, size, costs)
    lines = figures + [""] if len(figures) > 1 else []
    lines.append(format_plan(tiers, capacity, mtbf))
    if memory is not None:
        lines += ["", *format_memory_tier(memory)]
    if cfg is not None and size is not None:
        lines += ["", *_host_memory_lines(cfg, size, args.ranks_per_node)]
    lines += notes
    print("\n".join(lines))
    return 0
