"""Straggler detection numbers: ``python -m bench.straggler_numbers`` (root: the throttle is a cgroup).

Three measurements on 2-rank ``torchrun`` jobs of the tiny CPU model (``configs/tiny-cpu.yaml``),
``fault_tolerance.straggler.report_interval`` 5:

* **time to name**: once the job trained ``THROTTLE_AFTER`` steps, rank 1 is capped at half the CPU
  it was getting (``tests/cpu_throttle.py``, measured over 1 s first); steps and seconds from the cap
  to the first report naming rank 1 (threshold 0.7, the default, and the test's 0.3), per repeat.
* **false reports**: ``--clean-steps`` (1,000) steps nobody slows, a job alone after the others
  (once the host's load has settled, up to ``SETTLE_S``); reports naming any rank at the default
  threshold 0.7 and, from the same scores, at 0.5 and 0.3. The count means something on an idle
  host only: a rank another job starves scores like a throttled one. The host's load before and
  after is recorded, and ``measurement_problem`` says so when the host was not idle.
* **overhead**: detection on against detection off, alternating jobs (``bench.pairs.alternate``);
  seconds per step past a warm-up, median and spread of the per-repeat ratios.

Writes ``bench/results/stragglers-<date>.json``. Not part of ``make test``: minutes on 2 cores.
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

from bench.pairs import alternate
from pretrain.resilience.phases import ranks_in_phase
from tests.cpu_throttle import CpuCap

REPO = Path(__file__).resolve().parents[1]
INTERVAL = 5
THROTTLE_AFTER = 20
WARMUP_STEPS = 10
SETTLE_S = 90  # the 1-minute load average falls by e per minute: from the bench's own 2 ranks to 0.5 in ~85 s
IDLE_LOAD_PER_CPU = 0.25  # above this, before the clean job starts, other work shares the host


def _env() -> dict[str, str]:
    sockets = tempfile.mkdtemp(prefix="rp-s-")  # NVRx unix sockets: a short path
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TMPDIR": sockets}


def _corpus(work: Path) -> Path:
    corpus = work / "corpus"
    if not corpus.with_suffix(".bin").exists():
        cmd = [sys.executable, "-m", "pretrain", "prepare-data", "--synthetic-mb", "1", "--output", str(corpus)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=_env())
    return corpus


def _start(work: Path, name: str, steps: int, settings: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    run = work / name
    settings = [
        f"run.dir={run}",
        "run.id=b",
        f"data.prefix={_corpus(work)}",
        f"checkpoint.local.dir={run}/ckpt",
        "checkpoint.local.interval=100000",
        "checkpoint.reshardable.enabled=false",
        "metrics.enabled=false",
        f"train.steps={steps}",
        f"schedule.decay_steps={steps}",
        f"fault_tolerance.straggler.report_interval={INTERVAL}",
        *settings,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pretrain"]
    cmd += ["train", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]
    cmd += [x for item in settings for x in ("--set", item)]
    run.mkdir(parents=True, exist_ok=True)
    log = open(run / "job.log", "wb")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env()), run / "b"


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def _finish(proc: subprocess.Popen[bytes], run: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if proc.wait(timeout=3600) != 0:
        raise RuntimeError(f"bench job {run} failed: {(run.parent / 'job.log').read_text()[-3000:]}")
    reports = [e for e in _rows(run / "events.jsonl") if e["event"] == "straggler_report"]
    return reports, [m for m in _rows(run / "metrics.jsonl") if m.get("kind", "train") == "train"]


def _slow_ranks(report: dict[str, Any], threshold: float) -> list[int]:
    return [s["rank"] for s in report["scores"] if s["relative"] < threshold]


def time_to_name(work: Path, repeat: int) -> dict[str, Any]:
    proc, run = _start(work, f"throttled-{repeat}", THROTTLE_AFTER + 40, ["fault_tolerance.straggler.threshold=0.7"])

    def rank_1() -> int | None:
        return (ranks_in_phase(run, None, "training", [1]) or {}).get(1)

    def step() -> int:
        return max((m["step"] for m in _rows(run / "metrics.jsonl") if "step" in m), default=0)

    slow = CpuCap(rank_1, step, THROTTLE_AFTER, work / f"throttle-{repeat}.json")
    slow.start()
    try:
        reports, metrics = _finish(proc, run)
    finally:
        slow.stop.set()
        slow.join(timeout=30)
    if slow.error is not None or not slow.done:
        raise RuntimeError(f"throttle failed: {slow.error!r} {slow.done}")
    at, began = slow.done["step"], slow.done["time"]
    step_time = {m["step"]: m["time"] for m in metrics}
    out: dict[str, Any] = {"throttled_at_step": at, "measured_cpu": round(slow.done["rate"], 3)}
    for threshold in (0.7, 0.3):
        named = next((r for r in reports if r["step"] > at and 1 in _slow_ranks(r, threshold)), None)
        out[f"threshold_{threshold}"] = (
            {"steps": named["step"] - at, "seconds": round(step_time[named["step"]] - began, 2)} if named else None
        )
    out["scores_after"] = [
        round(next(s["relative"] for s in r["scores"] if s["rank"] == 1), 3) for r in reports if r["step"] > at
    ]
    return out


def _settled_load(cpus: int) -> float:
    """The 1-minute load average once it is below the idle mark, or after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    while os.getloadavg()[0] > IDLE_LOAD_PER_CPU * cpus and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def false_reports(work: Path, steps: int) -> dict[str, Any]:
    cpus = os.cpu_count() or 1
    load_before = _settled_load(cpus)
    reports, metrics = _finish(*_start(work, "clean", steps, []))
    lowest = min(s["relative"] for r in reports for s in r["scores"])
    busy = load_before > IDLE_LOAD_PER_CPU * cpus
    return {
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),  # includes the job's own 2 ranks
        "measurement_problem": (
            f"host not idle: load {load_before:.2f} on {cpus} CPUs before the clean job; the false-report "
            "count needs an idle host (nothing else running)"
            if busy
            else None
        ),
        "steps": steps,
        "reports": len(reports),
        "false_reports": {str(t): sum(1 for r in reports if _slow_ranks(r, t)) for t in (0.7, 0.5, 0.3)},
        "lowest_relative_score": round(lowest, 3),
        "steps_per_s": round((len(metrics) - 1) / (metrics[-1]["time"] - metrics[0]["time"]), 2),
    }


def overhead(work: Path, steps: int, repeats: int) -> dict[str, Any]:
    def seconds_per_step(enabled: bool, rep: int) -> float:
        name = f"overhead-{'on' if enabled else 'off'}-{rep}"
        _, metrics = _finish(*_start(work, name, steps, [f"fault_tolerance.straggler.enabled={str(enabled).lower()}"]))
        rows = metrics[WARMUP_STEPS:]
        return (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)

    pair = alternate(lambda r: seconds_per_step(True, r), lambda r: seconds_per_step(False, r), repeats, warmup=0)
    return pair.summary("time")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.straggler_numbers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clean-steps", type=int, default=1000)
    parser.add_argument("--overhead-steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-strag-") as tmp:
        work = Path(tmp)
        _corpus(work)
        results: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()}}
        results["report_interval"] = INTERVAL
        results["time_to_name"] = [time_to_name(work, r) for r in range(args.repeats)]
        results["overhead_on_vs_off"] = overhead(work, args.overhead_steps, args.repeats)
        # Alone, last: beside the other jobs its ranks would be starved by them (the first run
        # of this bench ran it beside them on a host at load 22-31 and counted 115 at 0.7).
        results["clean"] = false_reports(work, args.clean_steps)
    named = [t["threshold_0.7"] for t in results["time_to_name"] if t["threshold_0.7"]]
    if named:
        results["time_to_name_summary"] = {
            "steps_median": statistics.median(n["steps"] for n in named),
            "seconds_median": statistics.median(n["seconds"] for n in named),
            "seconds_spread": [min(n["seconds"] for n in named), max(n["seconds"] for n in named)],
        }
    results["host"]["load_at_end"] = os.getloadavg()
    results["wall_s"] = round(time.time() - started, 1)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"stragglers-{date}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
