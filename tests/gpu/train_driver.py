"""The GPU check's training runs, in one process: a baseline, and two kill-and-restart runs.

``python -m tests.gpu.train_driver --mode cuda|cpu --workdir DIR --out result.json``

1. ``pretrain.train.train`` runs ``tests/gpu/gpu-check.yaml`` for 30 steps (the baseline run);
2. tier-1 restore: the same config as run ``resumed`` raises an exception at step 17 (the
   in-process kill: the attempt fails, its process group and Megatron's state are torn down),
   then ``train`` is called again in the same process (the restart): it restores the newest
   tier-1 step (15, written in the background through pinned buffers on a side CUDA stream;
   the DistributedOptimizer's dp-reshardable parameter state) and trains to step 30;
3. reshardable restore: run ``from-reshardable`` (its saves synchronous until the fault) raises
   at step 12, its tier-1 directory is deleted (a lost node without replicas), and the restart
   restores the fully reshardable step 10 (the DistributedOptimizer loaded from Megatron's
   distributed checkpoint) and trains to 30.

Deterministic algorithms are on (``torch.use_deterministic_algorithms(True, warn_only=True)``,
``CUBLAS_WORKSPACE_CONFIG`` and, for Transformer Engine, ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``,
set before CUDA starts and TE is imported): each restarted run's losses must equal
the baseline's bit for bit; only where torch's warning names a kernel without a deterministic
implementation may they differ, within ``LOSS_TOLERANCE``, and the report names the kernels.
Each restarted run's newest tier-1 file must hold the Adam ``step`` of its step for every
parameter (one ``step`` tensor shared by all parameters would count every parameter each step).

A failed run is recorded and the next one still runs; the result file is rewritten after each
phase, so a driver killed by its time limit leaves what it had. ``--mode cpu`` (the dry run in
``make test``) runs the same code at CPU size: fp32, the local spec, a torch AdamW.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.gpu.determinism import apply as apply_deterministic_env

# Before torch initialises cuBLAS (its deterministic workspace) and Transformer Engine is imported
# (its fused attention's backward is nondeterministic otherwise, and TE's kernels raise no torch
# warning, so the tolerance rule below could not name them).
DETERMINISTIC_ENV = apply_deterministic_env(os.environ)

import torch  # noqa: E402

from pretrain.config import Config, load_config  # noqa: E402
from pretrain.data.prepare import build_indexed_dataset, synthetic_documents  # noqa: E402
from pretrain.model import resolve_spec_name  # noqa: E402
from pretrain.optim import uses_distributed_optimizer  # noqa: E402
from pretrain.train import train  # noqa: E402
from tests.gpu.driver_args import parse_driver_args  # noqa: E402

CONFIG = Path(__file__).with_name("gpu-check.yaml")
# The newest tier-1 step before it: 15 (every 5 steps) / 6 (every 2), or, where the fault kills
# that background write, the one before (10 / 4): a save waits for its predecessor to commit
# (when_busy: wait), so that one is never older than the newest reshardable step (10 / 4). A
# fault one step after a save (cpu: 6 after 4) could kill the only tier-1 write newer than the
# reshardable step on a loaded machine, and the restart would rightly restore that instead.
FAULT_STEP = {"cuda": 17, "cpu": 7}
# The reshardable-restore run: the newest reshardable step before it is 10 / 4 (every 10 / 4 steps).
RESHARD_FAULT_STEP = {"cuda": 12, "cpu": 6}
LOSS_TOLERANCE = 0.02  # nats, per step, only where torch names a kernel that is not deterministic
CPU_SIZE = [
    "model.num_layers=2",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "model.precision=fp32",
    "model.spec=local",
    "parallel.distributed_optimizer=off",
    "data.micro_batch_size=4",
    "train.steps=8",
    "checkpoint.local.interval=2",
    "checkpoint.reshardable.interval=4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(mode: str, workdir: Path, run_id: str, extra: list[str]) -> Config:
    sets = [
        f"run.id={run_id}",
        f"run.dir={workdir / 'runs'}",
        f"data.prefix={workdir / 'data' / 'corpus'}",
        f"checkpoint.local.dir={workdir / 'ckpt-local'}",
        f"checkpoint.reshardable.dir={workdir / 'ckpt-reshardable'}",
    ]
    return load_config(CONFIG, sets + (CPU_SIZE if mode == "cpu" else []) + extra)


def run_once(cfg: Config) -> str | None:
    """One call of the rank program in this process on a fresh port; the exception's line, if any."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        train(cfg)
    except Exception as exc:  # the injected fault (or a failed run): the process lives on
        return f"{type(exc).__name__}: {exc}"[:1000]
    return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def losses_by_attempt(run_dir: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        if rec.get("kind") in (None, "train") and "loss" in rec:
            out.setdefault(rec["attempt"], {})[int(rec["step"])] = float(rec["loss"])
    return out


def compare(baseline: dict[int, float], resumed: dict[int, float], nondeterministic: list[str]) -> dict[str, Any]:
    steps = sorted(resumed)
    diffs = [abs(resumed[s] - baseline[s]) for s in steps if s in baseline]
    identical = bool(steps) and all(resumed[s] == baseline.get(s) for s in steps)
    within = bool(diffs) and len(diffs) == len(steps) and max(diffs) <= LOSS_TOLERANCE
    return {
        "steps_compared": steps,
        "identical": identical,
        "max_abs_diff": max(diffs) if diffs else None,
        "tolerance": None if identical else LOSS_TOLERANCE,
        "tolerance_reason": None if identical else (nondeterministic or ["no torch warning named a kernel"]),
        "ok": identical or (within and bool(nondeterministic)),
    }


def saves(run_dir: Path) -> list[dict[str, Any]]:
    keep = ("tier", "step", "seconds", "blocked_seconds", "bytes", "attempt")
    return [{k: e.get(k) for k in keep} for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "save"]


def adam_steps(tree: Any) -> list[float]:
    """Every Adam ``step`` in an optimizer state: torch's per-parameter tensors, the entries of
    Megatron's dp-reshardable parameter state, the parameter groups' common step."""
    found: list[float] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "step" and isinstance(value, (torch.Tensor, int, float)):
                found.append(float(value))
            else:
                found.extend(adam_steps(value))
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            found.extend(adam_steps(value))
    return found


def newest_tier1_steps(local_dir: Path) -> dict[str, Any]:
    """The Adam steps in rank 0's newest committed tier-1 file (its own copy)."""
    files = sorted(
        (p for p in local_dir.glob("ranks/rank-00000/**/step-*/state.pt") if (p.parent / "COMMITTED").is_file()),
        key=lambda p: int(p.parent.name.split("-")[-1]),
    )
    if not files:
        return {"file": None, "step": None, "adam_steps": [], "count": 0}
    payload = torch.load(files[-1], map_location="cpu", weights_only=False)
    steps = adam_steps(payload["optimizer"])
    step = int(files[-1].parent.name.split("-")[-1])
    return {"file": str(files[-1]), "step": step, "adam_steps": sorted(set(steps)), "count": len(steps)}


def nondeterministic_kernels(caught: list[warnings.WarningMessage]) -> list[str]:
    return sorted({str(w.message).splitlines()[0] for w in caught if "determinis" in str(w.message)})


class Drive:
    """The phases of one check run; the result is written after each (see the module docstring)."""

    def __init__(self, mode: str, workdir: Path, out: Path) -> None:
        self.mode, self.workdir, self.out = mode, workdir, out
        self.result: dict[str, Any] = {"mode": mode, "errors": {}, "phase_errors": {}}
        self.caught: list[warnings.WarningMessage] = []

    def write(self) -> None:
        self.result["nondeterministic_warnings"] = nondeterministic_kernels(self.caught)
        self.result["deterministic_env"] = {k: os.environ.get(k) for k in DETERMINISTIC_ENV}
        self.out.write_text(json.dumps(self.result, indent=1, default=str))

    def phase(self, name: str, fn: Callable[[], None]) -> None:
        """Run one phase; an unexpected error is recorded (one line) and the next phase runs."""
        try:
            fn()
        except Exception as exc:  # a broken phase must not hide the evidence of the others
            self.result["phase_errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
        self.write()

    def baseline(self) -> None:
        base = config(self.mode, self.workdir, "baseline", [])
        self.result |= {
            "device": torch.cuda.get_device_name(0) if self.mode == "cuda" else "cpu",
            "spec": resolve_spec_name(base.model),
            "distributed_optimizer": uses_distributed_optimizer(base.parallel),
            "precision": base.model.precision,
            "steps": base.train.steps,
            "fault_step": FAULT_STEP[self.mode],
            # The reshard check loads the baseline's steps: it does not depend on a restart.
            "reshardable_dir": str(self.workdir / "ckpt-reshardable" / "baseline"),
        }
        t0 = time.perf_counter()
        self.result["errors"]["baseline"] = run_once(base)
        self.result["baseline_seconds"] = round(time.perf_counter() - t0, 2)

    def kill_and_restart(self, run_id: str, fault_step: int, lose_tier1: bool, fault_sets: list[str]) -> dict[str, Any]:
        inject = [f"fault_tolerance.inject.raise_at_step={fault_step}", "fault_tolerance.inject.raise_rank=0"]
        out: dict[str, Any] = {"fault_step": fault_step}
        out["fault_error"] = run_once(config(self.mode, self.workdir, run_id, inject + fault_sets))
        if lose_tier1:  # a lost node without replicas: only the reshardable tier is left
            shutil.rmtree(self.workdir / "ckpt-local" / run_id, ignore_errors=True)
        out["restart_error"] = run_once(config(self.mode, self.workdir, run_id, []))
        run_dir = self.workdir / "runs" / run_id
        attempts = losses_by_attempt(run_dir)
        names = list(attempts)  # in the order they ran (in-process attempts share a number)
        resumed = attempts[names[-1]] if len(names) >= 2 else {}
        baseline = next(iter(losses_by_attempt(self.workdir / "runs" / "baseline").values()), {})
        restore = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "restore"]
        return out | {
            "first_step_after_restart": min(resumed) if resumed else None,
            "restore_events": restore[-1:],
            "comparison": compare(baseline, resumed, nondeterministic_kernels(self.caught)),
            "saves": saves(run_dir),
            "tier1_after_restart": newest_tier1_steps(self.workdir / "ckpt-local" / run_id),
        }

    def tier1_restart(self) -> None:
        out = self.kill_and_restart("resumed", FAULT_STEP[self.mode], lose_tier1=False, fault_sets=[])
        self.result["errors"] |= {"fault": out.pop("fault_error"), "restart": out.pop("restart_error")}
        self.result |= out

    def reshardable_restart(self) -> None:
        # Its saves before the fault are synchronous: a background reshardable save started two
        # steps before the fault would be abandoned by it (nothing to restore but step 0).
        sync = ["checkpoint.async.enabled=false"]
        out = self.kill_and_restart("from-reshardable", RESHARD_FAULT_STEP[self.mode], True, fault_sets=sync)
        self.result["reshardable_restore"] = out

    def run(self) -> dict[str, Any]:
        shutil.rmtree(self.workdir, ignore_errors=True)  # an earlier check's checkpoints would be restored
        self.workdir.mkdir(parents=True)
        torch.use_deterministic_algorithms(True, warn_only=True)
        size = 2.0 if self.mode == "cuda" else 0.2
        build_indexed_dataset(synthetic_documents(size, seed=0), self.workdir / "data" / "corpus")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.caught = caught
            self.phase("baseline", self.baseline)
            self.phase("tier1_restart", self.tier1_restart)
            self.phase("reshardable_restart", self.reshardable_restart)
        return self.result


def main(argv: list[str] | None = None) -> int:
    args = parse_driver_args(__doc__, argv)
    result = Drive(args.mode, Path(args.workdir), Path(args.out)).run()
    reshard = result.get("reshardable_restore", {})
    print(json.dumps({"tier1": result.get("comparison"), "reshardable": reshard.get("comparison")}))
    ok = [result.get("comparison", {}).get("ok"), reshard.get("comparison", {}).get("ok")]
    return 0 if all(ok) and not result["phase_errors"] and result["errors"].get("baseline") is None else 1


if __name__ == "__main__":
    sys.exit(main())
