"""The GPU check's resilience run: what the in-process driver (``train_driver``) leaves out, as a
job runs it (issue 45 #20). One job of ``pretrain train`` under ``ft_launcher`` with its rank
monitor, every rank started by the standby process beside it (``ft_launcher_command``'s default),
tier 0 on every step, NVRx's in-process ``Wrapper`` on, and two faults on the launcher's first
attempt: an exception at ``RAISE_STEP`` (the Wrapper restarts in the same processes, restoring tier
0's step from memory) and, once the second incarnation has passed ``KILL_STEP``, a SIGKILL of rank 0
from outside the job (``PhaseKiller``: injected faults fire in a first incarnation only), after
which ``ft_launcher`` restarts the rank, a fork of the standby server again, and it restores tier
0's step: the tmpfs outlived the process.

World size: every visible GPU (two or more: DP > 1, the documented 2-GPU mode); one GPU: world 1
(NCCL refuses two ranks on one GPU). ``--mode cpu``: two gloo ranks (DP 2) at CPU size. The JSON
result holds the restores, the start events' pids, whether standby served, and the step times with
tier 0 on (the in-process driver's runs are the same model without it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from pretrain.resilience.outside_faults import Fault, PhaseKiller
from tests.gpu.driver_args import parse_driver_args
from tests.gpu.train_driver import CONFIG, CPU_SIZE

REPO = Path(__file__).resolve().parents[2]
FT_CONFIG = REPO / "configs" / "ft-cpu.yaml"
STEPS = {"cuda": 30, "cpu": 24}
RAISE_STEP = {"cuda": 8, "cpu": 5}
KILL_STEP = {"cuda": 14, "cpu": 9}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _last_step_before(metrics: list[dict[str, Any]], when: float | None) -> int | None:
    done = [int(m["step"]) for m in metrics if when is not None and m["time"] <= when]
    return max(done, default=None)


def _overrides(mode: str, workdir: Path, shm: Path) -> list[str]:
    sets = [
        "run.id=resilience",
        f"run.dir={workdir / 'runs'}",
        f"data.prefix={workdir / 'data' / 'corpus'}",
        f"checkpoint.local.dir={workdir / 'ckpt-local'}",
        f"checkpoint.reshardable.dir={workdir / 'ckpt-reshardable'}",
        "checkpoint.memory.enabled=true",
        f"checkpoint.memory.dir={shm}",
        "checkpoint.memory.interval=1",
        "fault_tolerance.enabled=true",
        "fault_tolerance.inprocess.enabled=true",
        "fault_tolerance.inject.raise_rank=0",
        f"fault_tolerance.inject.raise_at_step={RAISE_STEP[mode]}",
    ]
    size = CPU_SIZE if mode == "cpu" else []
    return [*size, *sets, f"train.steps={STEPS[mode]}", f"schedule.decay_steps={STEPS[mode]}"]


def run(mode: str, workdir: Path) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    build_indexed_dataset(synthetic_documents(2.0 if mode == "cuda" else 0.2, seed=0), workdir / "data" / "corpus")
    nproc = max(1, torch.cuda.device_count()) if mode == "cuda" else 2
    shm = Path("/dev/shm") / f"gpu-check-tier0-{uuid.uuid4().hex[:8]}"
    cmd = ft_launcher_command(CONFIG, nproc, FT_CONFIG, max_restarts=2, overrides=_overrides(mode, workdir, shm))
    run_dir = workdir / "runs" / "resilience"
    kill = Fault(0, "training", [0], after_step=KILL_STEP[mode])
    killer = PhaseKiller(run_dir, [kill])
    started = time.monotonic()
    killer.start()
    try:
        with (workdir / "job.log").open("w") as log:
            rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
    finally:
        killer.stop()
        killer.join(timeout=5)
        shutil.rmtree(shm, ignore_errors=True)
    events = _read_jsonl(run_dir / "events.jsonl")
    metrics = [m for m in _read_jsonl(run_dir / "metrics.jsonl") if m.get("kind", "train") == "train" and "loss" in m]
    text = (workdir / "job.log").read_text(errors="replace")
    return {
        "returncode": rc,
        "seconds": round(time.monotonic() - started, 1),
        "world_size": nproc,
        "steps": STEPS[mode],
        "raise_step": RAISE_STEP[mode],
        "kill_step": KILL_STEP[mode],
        "killer_error": killer.error,
        "killed_after_step": _last_step_before(metrics, kill.done.get("time")),
        "last_step": max((int(m["step"]) for m in metrics), default=0),
        "restores": [{k: e.get(k) for k in ("tier", "step", "attempt")} for e in events if e["event"] == "restore"],
        "starts": [{k: e.get(k) for k in ("pids", "incarnation", "attempt")} for e in events if e["event"] == "start"],
        "standby_served": "ranks start as forks" in text and "standby: not serving" not in text,
        "standby_lines": [line for line in text.splitlines() if line.startswith("standby:")][:6],
        "step_seconds": [round(b["time"] - a["time"], 3) for a, b in zip(metrics[-6:], metrics[-5:], strict=False)],
        "log_tail": text.splitlines()[-5:],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_driver_args(__doc__, argv)
    result = run(args.mode, Path(args.workdir))
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
