"""The GPU check's training run, in one process: a baseline, a kill and a restart.

``python -m tests.gpu.train_driver --mode cuda|cpu --workdir DIR --out result.json``

1. ``pretrain.train.train`` runs ``tests/gpu/gpu-check.yaml`` for 30 steps (the baseline run);
2. the same config as another run raises an exception at step 17 (the in-process kill: the
   attempt fails, its process group and Megatron's state are torn down);
3. ``train`` is called again in the same process (the restart): it restores the newest tier-1
   step (15, written in the background through pinned buffers on a side CUDA stream) and trains
   to step 30.

Deterministic algorithms are on (``torch.use_deterministic_algorithms(True, warn_only=True)``
and ``CUBLAS_WORKSPACE_CONFIG``, set before CUDA starts): the restarted run's losses for steps
16-30 must equal the baseline's bit for bit; where a kernel has no deterministic implementation,
torch's warning names it, and the losses must then agree within ``LOSS_TOLERANCE``.

``--mode cpu`` (the dry run in ``make test``) runs the same code at CPU size: fp32, the local
spec, a torch AdamW. The result (JSON) names the spec, the optimizer, the precision, the losses,
the restore, every save's blocked time and the warnings.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Before torch initialises cuBLAS: its deterministic workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from pretrain.config import Config, load_config  # noqa: E402
from pretrain.data.prepare import build_indexed_dataset, synthetic_documents  # noqa: E402
from pretrain.model import resolve_spec_name  # noqa: E402
from pretrain.optim import uses_distributed_optimizer  # noqa: E402
from pretrain.train import train  # noqa: E402
from tests.gpu.driver_args import parse_driver_args  # noqa: E402

CONFIG = Path(__file__).with_name("gpu-check.yaml")
FAULT_STEP = {"cuda": 17, "cpu": 6}  # the newest tier-1 step before it: 15 (every 5 steps) / 4 (every 2)
LOSS_TOLERANCE = 0.02  # nats, per step, only where a kernel is not deterministic (bf16 atomics)
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
    except Exception as exc:  # the injected fault: the attempt failed, the process lives on
        return f"{type(exc).__name__}: {exc}"
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


def drive(mode: str, workdir: Path) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)  # an earlier check's checkpoints would be restored
    workdir.mkdir(parents=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    build_indexed_dataset(synthetic_documents(2.0 if mode == "cuda" else 0.2, seed=0), workdir / "data" / "corpus")
    base = config(mode, workdir, "baseline", [])
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base_error = run_once(base)
        baseline_s = time.perf_counter() - t0
        inject = [f"fault_tolerance.inject.raise_at_step={FAULT_STEP[mode]}", "fault_tolerance.inject.raise_rank=0"]
        fault = config(mode, workdir, "resumed", inject)
        fault_error = run_once(fault)
        restart_error = run_once(config(mode, workdir, "resumed", []))
    nondeterministic = sorted({str(w.message).splitlines()[0] for w in caught if "determinis" in str(w.message)})
    base_losses = losses_by_attempt(workdir / "runs" / "baseline")
    attempts = losses_by_attempt(workdir / "runs" / "resumed")
    names = list(attempts)  # in the order they ran (in-process attempts share a number)
    resumed = attempts[names[-1]] if len(names) >= 2 else {}
    baseline = next(iter(base_losses.values()), {})
    restore = [e for e in read_jsonl(workdir / "runs" / "resumed" / "events.jsonl") if e.get("event") == "restore"]
    return {
        "mode": mode,
        "device": torch.cuda.get_device_name(0) if mode == "cuda" else "cpu",
        "spec": resolve_spec_name(base),
        "distributed_optimizer": uses_distributed_optimizer(base),
        "precision": base.model.precision,
        "steps": base.train.steps,
        "baseline_seconds": round(baseline_s, 2),
        "errors": {"baseline": base_error, "fault": fault_error, "restart": restart_error},
        "fault_step": FAULT_STEP[mode],
        "first_step_after_restart": min(resumed) if resumed else None,
        "restore_events": restore[-1:],
        "comparison": compare(baseline, resumed, nondeterministic),
        "saves": saves(workdir / "runs" / "resumed"),
        "reshardable_dir": str(workdir / "ckpt-reshardable" / "resumed"),
        "nondeterministic_warnings": nondeterministic,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_driver_args(__doc__, argv)
    result = drive(args.mode, Path(args.workdir))
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["comparison"]))
    return 0 if result["comparison"]["ok"] and result["errors"]["baseline"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
