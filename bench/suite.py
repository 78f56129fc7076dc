"""``make bench``: every checkpoint speed target as a ratio measured side by side in one run.

For each state size (default ~300 MB and ~2 GB), medians of ``--repeats`` runs:

* blocked: seconds training is blocked per background save (fork snapshot) / a synchronous
  ``torch.save`` + fsync of the same state (target <= 1/50, required <= 1/20);
* local throughput: a raw durable sequential write of the same bytes / the tier-1 publish
  (write + fsync + SHA-256 manifest + rename + COMMITTED), i.e. throughput ratio (target >= 0.8);
* restore: tier-1 restore (verify every byte + load) / a raw read of the same bytes (target <= 1.2x);
* S3 (when ``S3_ENDPOINT_URL`` is set): promotion incl. SHA-256 / raw boto3 ``upload_file`` (>= 0.9);
* steps/s: the tiny 2-rank job with background tier-1 saves every ``--interval`` steps / the same
  job without checkpoints (target >= 0.99).

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

from bench.replication_numbers import raw_durable_write
from pretrain.checkpointing.async_writer import BackgroundWrite
from tiering.collective import SingleProcess
from tiering.layout import RunLayout
from tiering.publish import PosixStepPublisher, manifest_for
from tiering.verify import verify_step

REPO = Path(__file__).resolve().parents[1]
TARGETS = {
    "blocked_per_save": ("<=", 1 / 50),
    "local_throughput": (">=", 0.8),
    "restore_vs_raw_read": ("<=", 1.2),
    "s3_promotion_throughput": (">=", 0.9),
    "steps_per_s_with_ckpt": (">=", 0.99),
}


def _sync_save(state: dict[str, Any], path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def _raw_read(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(16 * 1024 * 1024):
            pass
    return time.perf_counter() - t0


def measure_size(mb: int, repeats: int, work: Path) -> dict[str, Any]:
    state = {"model": {"w": torch.randn(mb * 1024 * 1024 // 4)}, "step": 1}
    nbytes = state["model"]["w"].numel() * 4
    rows = []
    for rep in range(repeats):
        d = work / f"{mb}-{rep}"
        d.mkdir(parents=True)
        sync_s = _sync_save(state, d / "sync.pt")
        (d / "sync.pt").unlink()
        write = BackgroundWrite("fork", state, d / "bg.pt")
        blocked = write.blocked_seconds
        state["model"]["w"].add_(1.0)  # training goes on while the child writes the snapshot
        outcome = write.poll(block=True)
        assert outcome is not None and outcome.ok, outcome
        background_total = outcome.seconds
        (d / "bg.pt").unlink()
        raw_w = raw_durable_write(d / "raw.bin", nbytes)
        layout = RunLayout(d / "tier", "bench")
        pub = PosixStepPublisher(layout, SingleProcess(), f"b{rep}")
        t0 = time.perf_counter()
        tmp = pub.begin(10)
        _sync_save(state, tmp / "state.pt")
        pub.commit(tmp, manifest_for("bench", 10, 1, {"tp": 1, "pp": 1, "dp": 1}))
        tier_w = time.perf_counter() - t0
        raw_r = _raw_read(layout.step_dir(10) / "state.pt")  # the same bytes, read plainly
        t1 = time.perf_counter()
        verify_step(layout.step_dir(10))
        torch.load(layout.step_dir(10) / "state.pt", weights_only=True)
        tier_r = time.perf_counter() - t1
        rows.append(
            {
                "sync_save_s": sync_s,
                "blocked_s": blocked,
                "background_total_s": background_total,
                "raw_write_s": raw_w,
                "tier_write_s": tier_w,
                "raw_read_s": raw_r,
                "tier_restore_s": tier_r,
            }
        )
        subprocess.run(["rm", "-rf", str(d)], check=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "size_mb": round(nbytes / 1e6),
        "repeats": repeats,
        **{k: round(v, 4) for k, v in med.items()},
        "blocked_per_save": med["blocked_s"] / med["sync_save_s"],
        "local_throughput": med["raw_write_s"] / med["tier_write_s"],
        "restore_vs_raw_read": med["tier_restore_s"] / med["raw_read_s"],
    }


def measure_steps(work: Path, interval: int, steps: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TMPDIR": tempfile.mkdtemp(prefix="rp-b-")}
    corpus = work / "corpus"
    subprocess.run(
        [sys.executable, "-m", "pretrain", "prepare-data", "--synthetic-mb", "1", "--output", str(corpus)],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    rates = {}
    for name, sets in (
        ("none", ["checkpoint.local.interval=100000", "checkpoint.reshardable.enabled=false"]),
        ("background", [f"checkpoint.local.interval={interval}", "checkpoint.reshardable.enabled=false"]),
    ):
        run = work / name
        settings = [
            f"run.dir={run}",
            "run.id=b",
            f"data.prefix={corpus}",
            f"checkpoint.local.dir={run}/ckpt",
            f"train.steps={steps}",
            "metrics.enabled=false",
            *sets,
        ]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pretrain"]
        cmd += ["train", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]
        cmd += [x for item in settings for x in ("--set", item)]
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        rows = [json.loads(x) for x in (run / "b" / "metrics.jsonl").read_text().splitlines()]
        rows = rows[10:]  # past warm-up
        rates[name] = (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"])
    return {
        "interval_steps": interval,
        "steps_per_s_none": round(rates["none"], 2),
        "steps_per_s_background": round(rates["background"], 2),
        "steps_per_s_with_ckpt": rates["background"] / rates["none"],
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


def _passes(name: str, value: float) -> bool:
    op, target = TARGETS[name]
    return value <= target if op == "<=" else value >= target


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, goals, colors = [], [], [], []
    for row in results["sizes"]:
        for key in ("blocked_per_save", "local_throughput", "restore_vs_raw_read"):
            labels.append(f"{key}\n{row['size_mb']} MB")
            values.append(row[key])
            goals.append(TARGETS[key][1])
            colors.append("tab:green" if _passes(key, row[key]) else "tab:red")
    for row in (r for r in results.get("s3", []) if "error" not in r):
        labels.append(f"s3_promotion\n{row['size_mb']} MB")
        values.append(row["promotion_ratio"])
        goals.append(TARGETS["s3_promotion_throughput"][1])
        colors.append("tab:green" if _passes("s3_promotion_throughput", row["promotion_ratio"]) else "tab:red")
    steps = results["steps"]
    labels.append(f"steps/s ratio\nsave every {steps['interval_steps']}")
    values.append(steps["steps_per_s_with_ckpt"])
    goals.append(TARGETS["steps_per_s_with_ckpt"][1])
    colors.append("tab:green" if _passes("steps_per_s_with_ckpt", steps["steps_per_s_with_ckpt"]) else "tab:red")
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.3), 4.5))
    xs = range(len(labels))
    ax.bar(xs, values, color=colors)
    ax.scatter(xs, goals, marker="_", s=600, color="black", label="target")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")  # ratios span 1/50 to 30x
    ax.set_ylabel("ratio (same run, same machine), log scale")
    ax.set_title(f"Checkpoint benchmarks {results['date']} (green: target met)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=int, default=20, help="steps between background saves in the steps/s run")
    parser.add_argument("--steps", type=int, default=300)
    # The test RGW keeps objects in RAM (memstore): ~2 GB objects x repeats strain a 24 GB machine.
    parser.add_argument("--s3-sizes-mb", type=int, nargs="+", default=[300])
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        results: dict[str, Any] = {
            "date": date,
            "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
            "sizes": [measure_size(mb, args.repeats, Path(td) / "sizes") for mb in args.sizes_mb],
            "steps": measure_steps(Path(td) / "steps", args.interval, args.steps),
        }
        if os.environ.get("S3_ENDPOINT_URL"):
            results["s3"] = measure_s3(os.environ["S3_ENDPOINT_URL"], args.s3_sizes_mb, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{date}.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, out / f"{date}.png")
    print("| measure | size | ratio | target | met |\n|---|---|---|---|---|")
    for row in results["sizes"]:
        for key in ("blocked_per_save", "local_throughput", "restore_vs_raw_read"):
            op, goal = TARGETS[key]
            met = "yes" if _passes(key, row[key]) else "no"
            print(f"| {key} | {row['size_mb']} MB | {row[key]:.3f} | {op} {goal:.3g} | {met} |")
    for row in results.get("s3", []):
        if "error" in row:
            print(f"| s3_promotion_throughput | - | failed: {row['error']} | >= 0.9 | no |")
            continue
        v = row["promotion_ratio"]
        print(f"| s3_promotion_throughput | {row['size_mb']} MB | {v:.3f} | >= 0.9 | {'yes' if v >= 0.9 else 'no'} |")
    s = results["steps"]
    print(f"| steps_per_s_with_ckpt | save every {s['interval_steps']} | {s['steps_per_s_with_ckpt']:.3f} | >= 0.99 | "
          f"{'yes' if _passes('steps_per_s_with_ckpt', s['steps_per_s_with_ckpt']) else 'no'} |")  # fmt: skip
    print(f"wrote {out / (date + '.json')} and {out / (date + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
