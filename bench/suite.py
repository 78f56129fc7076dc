"""``make bench``: every checkpoint speed target as a ratio measured side by side in one run.

Every ratio pairs a product path with a raw baseline of the same bytes in the same layout,
alternating which runs first, and reports the median with the spread of the per-repeat ratios
(:mod:`bench.pairs`); a ratio that beats its raw baseline by more than the baseline's own noise is
flagged as a measurement problem, never counted as met. For each state size (default ~300 MB and
~2 GB per rank):

* publish: the tier-1 save path / a raw durable write of the same serialized bytes (>= 0.9);
* restore: verify every chunk + load the verified file / a raw read of the same bytes on as many
  threads, page cache evicted (<= 1.2x) and warm (<= 2x); peak restore RSS / state size (<= 1.3);
* peer restore: tier 1-2 recovery from a peer's replica / the same bytes read and sent raw and
  written into a new file on the restoring node, as the raw S3 ranged GETs land an object
  (<= 1.3x); beside it, against the wire alone (received into memory that exists, no target: the
  difference is the machine's cost of new memory, which every restore pays);
* the pairs that land bytes in new memory (publish, cold restore, peer restore) start every run
  from the same memory state: on a VM with free page reporting, after the host can have taken
  back what the run before freed (:mod:`bench.memory_state`);
* blocked: seconds the real trainer (``pretrain train``, 2 ranks, a GPT sized to the state) is
  blocked per background tier-1 save, per writer mode, over a synchronous ``torch.save`` + fsync
  of the same state file (<= 1/50);
* save cost (reported, :mod:`bench.save_cost`): blocked seconds and step excess (the step after a
  save minus a plain step) per save for tier 1 in thread and fork modes and for tier 0, repeated
  jobs with spread; the tier-1 mode with the smaller cost is ``best_mode`` (the config default);
* S3 (when ``S3_ENDPOINT_URL`` is set): promotion / ``upload_file`` (>= 0.95) and verified restore /
  the same ranged GETs written but not hashed (<= 1.15x; the faster raw path: ``download_file``,
  said beside it, was beaten by the verified restore, so it does not measure the limit);
* steps/s: the ~300 MB trainer with tier-1 saves at the planner's interval (Daly, from the measured
  cost of a save) / the same trainer without checkpoints (>= 0.99).

Writes ``bench/results/<date>.json`` and ``bench/results/<date>.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.io_numbers import measure_local, measure_peer
from bench.save_cost import measure_save_cost
from pretrain.commands.plan import mtbf_from_failures, plan_tier
from pretrain.config import AsyncSaveConfig
from tiering.digest import DEFAULT_CHUNK_BYTES, LOCAL_HASH, HashSpec

REPO = Path(__file__).resolve().parents[1]
TARGETS = {
    "blocked_per_save": ("<=", 1 / 50),
    "publish": (">=", 0.9),
    "restore_cold": ("<=", 1.2),
    "restore_warm": ("<=", 2.0),
    "restore_rss": ("<=", 1.3),
    "peer_restore": ("<=", 1.3),
    "s3_promotion": (">=", 0.95),
    "s3_restore": ("<=", 1.15),
    "steps_per_s_with_ckpt": (">=", 0.99),
}
# GPTs whose per-rank tier-1 state (fp32 weights + Adam's two moments, 12 B/param) is ~300 MB
# and ~2 GB; one short sequence per rank and step keeps a CPU step in seconds.
MODELS = {
    300: ["model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8"],
    2000: ["model.num_layers=9", "model.hidden_size=1280", "model.num_attention_heads=10"],
}
DEFAULT_MODE = "thread" if AsyncSaveConfig().mode == "auto" else AsyncSaveConfig().mode
SMALL_BATCH = ["model.seq_length=64", "data.global_batch_size=2", "data.micro_batch_size=1"]
# The seed's fleet record: 466 interruptions in 54 days on 16,384 GPUs (a job on all of them).
FLEET = {"failures": 466, "days": 54.0, "cluster_gpus": 16384, "job_gpus": 16384}


def _sync_save(state: dict[str, Any], path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def measure_io(mb: int, repeats: int, work: Path) -> dict[str, Any]:
    """Publish, restore (cold, warm, RSS) and peer restore of a ``mb`` MB state (bench.io_numbers)."""
    row = measure_local(mb, repeats, work / f"local-{mb}", HashSpec(LOCAL_HASH, DEFAULT_CHUNK_BYTES, 2))
    row.update(measure_peer(mb, repeats, work / f"peer-{mb}"))
    return row


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": tempfile.mkdtemp(prefix="rp-b-"),
    }


def _corpus(work: Path) -> Path:
    corpus = work / "corpus"
    if not corpus.with_suffix(".bin").exists():
        subprocess.run(
            [sys.executable, "-m", "pretrain", "prepare-data", "--synthetic-mb", "1", "--output", str(corpus)],
            check=True,
            stdout=subprocess.DEVNULL,
            env=_env(),
        )
    return corpus


def _train(work: Path, name: str, settings: list[str]) -> list[dict[str, Any]]:
    """One 2-rank ``pretrain train`` job; returns its events (metrics rows under "metrics")."""
    run = work / name
    settings = [
        f"run.dir={run}",
        "run.id=b",
        f"data.prefix={_corpus(work)}",
        f"checkpoint.local.dir={run}/ckpt",
        "checkpoint.reshardable.enabled=false",
        "metrics.enabled=false",
        *settings,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pretrain"]
    cmd += ["train", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]
    cmd += [x for item in settings for x in ("--set", item)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if out.returncode != 0:
        raise RuntimeError(f"bench job {name} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "b" / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run / "b" / "metrics.jsonl").read_text().splitlines()]
    return [*rows, {"event": "metrics", "rows": metrics, "ckpt": str(run / "ckpt")}]


def _steps_per_s(metrics: list[dict[str, Any]], skip: int) -> float:
    rows = metrics[skip:]  # past warm-up
    return (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"])


def measure_blocked(work: Path, mb: int, steps: int, repeats: int) -> dict[str, Any]:
    """What a save costs the real trainer (bench.save_cost: blocked seconds and step excess for
    tier 1 in thread and fork modes and for tier 0, repeated, with spread), and the blocked time
    against a synchronous torch.save + fsync of one of the state files tier 1 wrote."""
    work = work / str(mb)
    cost = measure_save_cost(_train, work, mb, MODELS[mb] + SMALL_BATCH, steps, repeats)
    out: dict[str, Any] = {"size_mb": mb, "steps": steps, "save_cost": cost}
    for mode in ("fork", "thread"):
        case = cost["cases"][f"tier1-{mode}"]
        out[f"blocked_{mode}_s"] = case["blocked_s"]["median"]
        out[f"step_excess_{mode}_s"] = case["step_excess_s"]["median"]
        out[f"cost_{mode}_s"] = case["cost_s"]["median"]
        out[f"step_s_{mode}"] = case["mean_step_s"]["median"]
    state_file = work / "state.pt"
    out["state_mb"] = round(state_file.stat().st_size / 1e6)
    state = torch.load(state_file, weights_only=True)
    sync = [_sync_save(state, work / "sync.pt") for _ in range(3)]
    (work / "sync.pt").unlink()
    state_file.unlink()
    del state
    out["sync_save_s"] = round(statistics.median(sync), 4)
    for mode in ("fork", "thread"):
        out[f"blocked_per_save_{mode}"] = out[f"blocked_{mode}_s"] / out["sync_save_s"]
    out["blocked_per_save"] = min(out["blocked_per_save_fork"], out["blocked_per_save_thread"])
    # The mode that costs training less per save (step excess, not only the blocked time); when the
    # two cannot be told apart, the configured default (auto: thread).
    out["best_mode"] = cost["default_mode"]["mode"] or DEFAULT_MODE
    return out


def measure_steps(work: Path, save_cost: float, mode: str, intervals: int) -> dict[str, Any]:
    """steps/s with tier-1 saves at the planner's interval / steps/s without checkpoints.

    Daly's delta is what one save costs training, measured (bench.save_cost: the step after a
    save minus a plain step, never less than the blocked time). The job MTBF is Meta's Llama 3
    fleet record.
    """
    mtbf = mtbf_from_failures(**FLEET)
    model = MODELS[300] + SMALL_BATCH + [f"checkpoint.async.mode={mode}"]
    ev = _train(work / "steps", "probe", [*model, "checkpoint.local.interval=100000", "train.steps=60"])
    step_s = 1 / _steps_per_s(ev[-1]["rows"], 3)
    plan = plan_tier("local", save_cost, restore_s=10.0, mtbf_s=mtbf, step_s=step_s, detect_restart_s=30.0)
    interval = plan.interval_steps or 1
    steps = interval * intervals + 5
    # Both jobs run the same steps (a longer job is not slower for free: data, logs, the machine).
    ev = _train(work / "steps", "none", [*model, "checkpoint.local.interval=100000", f"train.steps={steps}"])
    rate_none = _steps_per_s(ev[-1]["rows"], 3)
    ev = _train(work / "steps", "planned", [*model, f"checkpoint.local.interval={interval}", f"train.steps={steps}"])
    rate_planned = _steps_per_s(ev[-1]["rows"], 3)
    return {
        "mtbf_s": round(mtbf),
        "save_cost_s": round(save_cost, 4),
        "writer_mode": mode,
        "planned_interval_s": round(plan.daly_interval_s, 1),
        "interval_steps": interval,
        "steps": steps,
        "steps_per_s_none": round(rate_none, 3),
        "steps_per_s_planned": round(rate_planned, 3),
        "steps_per_s_with_ckpt": rate_planned / rate_none,
    }


def measure_s3(endpoint: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Runs bench.s3_numbers; a failure is reported in the results instead of losing the others."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.s3_numbers", "--endpoint-url", endpoint, "--repeats", str(repeats),
         "--sizes-mb", *map(str, sizes)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    if out.returncode != 0:
        return [{"error": (out.stdout + out.stderr).strip().splitlines()[-1][-500:]}]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _passes(name: str, value: float, note: str = "") -> bool:
    op, target = TARGETS[name]
    return "MEASUREMENT PROBLEM" not in note and (value <= target if op == "<=" else value >= target)


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _table(results)
    labels = [f"{name}\n{where}" for name, where, value, _ in rows if value is not None]
    values = [value for _, _, value, _ in rows if value is not None]
    goals = [TARGETS[name][1] for name, _, value, _ in rows if value is not None]
    colors = ["tab:green" if _passes(name, v, note) else "tab:red" for name, _, v, note in rows if v is not None]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.3), 4.5))
    xs = range(len(labels))
    ax.bar(xs, values, color=colors)
    ax.scatter(xs, goals, marker="_", s=600, color="black", label="target")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")  # ratios span 1/50 to several x
    ax.set_ylabel("ratio (same run, same machine), log scale")
    ax.set_title(f"Checkpoint benchmarks {results['date']} (green: target met)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


Row = tuple[str, str, float | None, str]


def _pair_row(name: str, where: str, pair: dict[str, Any]) -> Row:
    """One paired measurement: its median ratio, spread, seconds, and a flagged measurement problem."""
    lo, hi = pair["ratio_spread"]
    note = f"[{lo:.2f}-{hi:.2f}] {pair['measured_s']:.3f} s vs {pair['raw_s']:.3f} s raw, n={pair['repeats']}"
    if pair.get("measurement_problem"):
        note += f"; MEASUREMENT PROBLEM: {pair['measurement_problem']}"
    return (name, where, pair["ratio"], note)


def _wire(row: Row, wire: dict[str, Any] | None, label: str = "the wire alone") -> Row:
    """A row's second baseline, said beside it: for the peer row the wire alone (the bytes received
    into memory that exists: what landing them in new memory costs on this machine), for the S3
    restore boto3's ``download_file`` (the row's own baseline is the same ranged GETs unverified)."""
    if not wire:
        return row
    lo, hi = wire["ratio_spread"]
    extra = f"; vs {label}: {wire['ratio']:.2f} [{lo:.2f}-{hi:.2f}] ({wire['raw_s']:.3f} s raw)"
    return (row[0], row[1], row[2], row[3] + extra)


def _table(results: dict[str, Any]) -> list[Row]:
    """(measure, where, ratio, note) rows of the printed table and the chart."""
    rows: list[Row] = []
    for b in results["blocked"]:
        for mode in ("fork", "thread"):
            note = f"{b[f'blocked_{mode}_s']:.4f} s vs {b['sync_save_s']:.3f} s sync"
            rows.append(("blocked_per_save", f"{b['state_mb']} MB {mode}", b[f"blocked_per_save_{mode}"], note))
    for r in results.get("io", []):
        mb = f"{r['size_mb']} MB"
        rows.append(_pair_row("publish", mb, r["publish"]))
        rows.append(_pair_row("restore_cold", mb, r["restore_cold"]))
        rows.append(_pair_row("restore_warm", mb, r["restore_warm"]))
        rss = r["restore_rss"]
        rows.append(("restore_rss", mb, rss["ratio"], f"{rss['growth_bytes'] / 1e6:.0f} MB growth, model allocated"))
        rows.append(_wire(_pair_row("peer_restore", mb, r["peer_restore"]), r["peer_restore"].get("wire")))
    for r in results.get("s3", []):
        if "error" in r:
            rows.append(("s3_promotion", "-", None, f"failed: {r['error']}"))
            continue
        rows.append(_pair_row("s3_promotion", f"{r['size_mb']} MB", r["promotion"]))
        restore = _pair_row("s3_restore", f"{r['size_mb']} MB", r["restore"])
        rows.append(_wire(restore, r["restore"].get("download_file"), "boto3 download_file"))
    st = results.get("steps")
    if st:
        note = f"{st['steps_per_s_planned']} vs {st['steps_per_s_none']} steps/s, Daly {st['planned_interval_s']} s"
        rows.append(("steps_per_s_with_ckpt", f"every {st['interval_steps']} steps", st["steps_per_s_with_ckpt"], note))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 2000], choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="alternating pairs per I/O ratio")
    parser.add_argument("--trainer-steps", type=int, default=11, help="steps of each save-cost job (save every 3)")
    parser.add_argument("--trainer-repeats", type=int, default=3, help="jobs per save-cost case (rotating order)")
    parser.add_argument("--intervals", type=int, default=2, help="planned intervals in the steps/s job")
    # The test RGW keeps objects in RAM (memstore): ~2 GB objects x repeats strain a 24 GB machine.
    parser.add_argument("--s3-sizes-mb", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["io", "s3", "blocked", "steps"],
        choices=["io", "s3", "blocked", "steps"],
        help="what to measure (steps needs blocked)",
    )
    parser.add_argument(
        "--steps-only", action="store_true", help="re-measure only the steps/s ratio into today's results file"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the parts of today's results file that this run does not measure (each part says when it ran)",
    )
    args = parser.parse_args()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out)
    if args.merge and (out / f"{date}.json").is_file():
        kept = json.loads((out / f"{date}.json").read_text())
        results = _measure(args, date)
        when = kept.get("measured_at", {})
        for part in ("io", "s3", "blocked", "steps"):
            if results.get(part):
                when[part] = results["measured_at"][part]
            elif kept.get(part):
                results[part] = kept[part]
                when.setdefault(part, f"{date}, an earlier run")
        results["measured_at"] = when
        return _write(results, out, date)
    if args.steps_only:
        results = json.loads((out / f"{date}.json").read_text())
        small = results["blocked"][0]
        mode = small["best_mode"]
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
            results["steps"] = measure_steps(Path(td), small[f"cost_{mode}_s"], mode, args.intervals)
        results["steps"]["measured_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
        return _write(results, out, date)
    return _write(_measure(args, date), out, date)


def _measure(args: argparse.Namespace, date: str) -> dict[str, Any]:
    """Every part ``args.parts`` names, measured now; ``measured_at``: when each part ran."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        work = Path(td)
        results: dict[str, Any] = {
            "date": date,
            "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
            "fleet": FLEET,
            "blocked": [],
        }
        if "io" in args.parts:
            results["io"] = [measure_io(mb, args.repeats, work / "io") for mb in args.sizes_mb]
        if "s3" in args.parts and os.environ.get("S3_ENDPOINT_URL"):
            results["s3"] = measure_s3(os.environ["S3_ENDPOINT_URL"], args.s3_sizes_mb, args.repeats)
        if "blocked" in args.parts or "steps" in args.parts:
            results["blocked"] = [
                measure_blocked(work / "blocked", mb, args.trainer_steps, args.trainer_repeats) for mb in args.sizes_mb
            ]
        if "steps" in args.parts:
            small = results["blocked"][0]
            mode = small["best_mode"]
            results["steps"] = measure_steps(work, small[f"cost_{mode}_s"], mode, args.intervals)
    results["measured_at"] = {part: now for part in ("io", "s3", "blocked", "steps") if results.get(part)}
    return results


def save_cost_table(results: dict[str, Any]) -> str:
    """Blocked time and step excess per save, per case and size: median [min-max] over the jobs."""

    def cell(fig: dict[str, Any], unit: str = "s") -> str:
        lo, hi = fig["spread"]
        return f"{fig['median']:.3f} [{lo:.3f}-{hi:.3f}] {unit}".rstrip()

    lines = ["| save cost | case | blocked | step excess | plain step | cost / plain step | jobs |", "|---" * 7 + "|"]
    for b in results.get("blocked", []):
        cost = b.get("save_cost")
        if not cost:
            continue
        for name, c in cost["cases"].items():
            lines.append(
                f"| {b['size_mb']} MB | {name} | {cell(c['blocked_s'])} | {cell(c['step_excess_s'])} | "
                f"{cell(c['plain_step_s'])} | {cell(c['cost_per_step'], '')} | {c['repeats']} |"
            )
        for name, why in cost["skipped"].items():
            lines.append(f"| {b['size_mb']} MB | {name} | skipped: {why} | | | | |")
        ratio = cost.get("agent_over_in_process")
        if ratio:
            what = "step excess through the agent / in the rank"
            lines.append(f"| {b['size_mb']} MB | {what} | {cell(ratio, 'x')} | | | | |")
        best = cost["default_mode"]
        said = (
            f"tier-1 mode with the smaller cost: {best['mode']}"
            if best.get("mode")
            else f"tier-1 modes within noise (median leans {best.get('smaller_median')}): default kept"
        )
        lines.append(f"| {b['size_mb']} MB | {said} | | | | | |")
    return "\n".join(lines)


def _write(results: dict[str, Any], out: Path, date: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{date}.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, out / f"{date}.png")
    print("| measure | where | ratio | target | met | measured |\n|---|---|---|---|---|---|")
    for name, where, value, note in _table(results):
        op, goal = TARGETS[name]
        shown = "-" if value is None else f"{value:.3f}"
        met = "no" if value is None else ("yes" if _passes(name, value, note) else "no")
        print(f"| {name} | {where} | {shown} | {op} {goal:.3g} | {met} | {note} |")
    print(save_cost_table(results))
    print(f"wrote {out / (date + '.json')} and {out / (date + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
