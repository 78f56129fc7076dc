"""Numbers for the vertical slice on this machine: steps/s at 1 and 2 ranks, checkpoint size,
save, verify and restore seconds. Run: ``python -m bench.slice_numbers`` (after ``make venv``).

Every figure comes from real torchrun jobs of the tiny config measured in this run.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.replication_numbers import raw_durable_write
from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from tests.helpers import events, metrics_by_step, overrides_for, torchrun
from tiering.verify import verify_step


def _steps_per_second(run_dir: Path, save_steps: set[int]) -> float:
    m = metrics_by_step(run_dir)
    gaps = [m[s]["time"] - m[s - 1]["time"] for s in sorted(m) if s - 1 in m and (s - 1) not in save_steps]
    return 1.0 / statistics.median(gaps)


def measure(nproc: int, work: Path, corpus: Path) -> dict[str, float]:
    job = work / f"ranks{nproc}"
    common = {
        "train.steps": 60,
        "checkpoint.local.interval": 10,
        "checkpoint.reshardable.interval": 20,
        "train.log_interval": 1000,
        "checkpoint.replication.allow_same_domain": "true",
    }
    torchrun(job, nproc, overrides_for(job, corpus, **common), timeout=600)
    ev = events(job / "runs" / "t")
    saves = [e for e in ev if e["event"] == "save" and e["tier"] == "reshardable"]
    local = [e for e in ev if e["event"] == "save" and e["tier"] == "local"]
    raw = raw_durable_write(job / "raw.bin", local[-1]["bytes"])
    step_dir = job / "reshard" / "t" / "steps" / "step-000000060"
    t0 = time.perf_counter()
    verify_step(step_dir)
    verify_s = time.perf_counter() - t0
    torchrun(job, nproc, overrides_for(job, corpus, **{**common, "train.steps": 61}), timeout=600)
    restore = [e for e in events(job / "runs" / "t") if e["event"] == "restore"][-1]
    assert restore["tier"] == "local"
    return {
        "ranks": nproc,
        "steps_per_second": round(_steps_per_second(job / "runs" / "t", {e["step"] for e in saves + local}), 2),
        "local_mb_per_rank": round(local[-1]["bytes"] / 1e6, 2),
        "local_save_s": round(statistics.median(e["seconds"] for e in local), 3),
        "replication_s": round(statistics.median(e["replication_seconds"] for e in local), 3),
        "raw_durable_write_s": round(raw, 4),
        "checkpoint_mb": round(saves[-1]["bytes"] / 1e6, 2),
        "save_seconds_first": round(saves[0]["seconds"], 3),
        "save_seconds_median": round(statistics.median(e["seconds"] for e in saves[1:]), 3),
        "verify_seconds": round(verify_s, 3),
        "restore_local_seconds": round(restore["seconds"], 3),
    }


def main() -> int:
    with tempfile.TemporaryDirectory() as td:
        work = Path(td)
        corpus = work / "data" / "corpus"
        build_indexed_dataset(synthetic_documents(1.0), corpus)
        rows = [measure(n, work, corpus) for n in (1, 2)]
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
