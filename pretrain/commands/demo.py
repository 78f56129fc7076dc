"""``pretrain demo`` / ``make demo``: the main job at CPU scale, with one injected failure.

Two ranks train the tiny GPT under ``ft_launcher`` on real text (the Python standard library's
sources, with a BPE tokenizer trained on them at demo time: :mod:`pretrain.commands.demo_data`),
evaluating the validation loss every 40 steps; rank 1 is SIGKILLed once (first attempt only) after
a checkpoint; the launcher restarts the group, which restores the newest verified step (tier 0,
the state of the last step or the one before it in ``/dev/shm``, so 0 or 1 steps are lost) and
finishes. Prints a recovery summary with the validation losses before and after the failure and
the corpus's unigram entropy, and writes it to ``<workdir>/recovery-summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pretrain.commands.demo_data import prepare, unigram_entropy
from pretrain.commands.ft_command import ft_launcher_command
from pretrain.commands.summary import format_report, summarize
from pretrain.config import load_config

FT_CONFIG = {
    "fault_tolerance": {
        "initial_rank_heartbeat_timeout": 120.0,
        "rank_heartbeat_timeout": 60.0,
        "workload_check_interval": 1.0,
        "rank_termination_signal": "SIGKILL",
    }
}


DEMO_MB = 2.0  # of standard-library sources: a few seconds to tokenize, enough for 60 steps
VOCAB = 512


def memory_dir(work: Path, command: str = "demo") -> Path:
    """A command's tier-0 root: on the machine's tmpfs, one per work directory (removed at the end)."""
    return Path("/dev/shm") / f"resilient-pretrain-{command}-{hashlib.sha256(str(work).encode()).hexdigest()[:10]}"


def _settings(work: Path, data_prefix: Path, tokenizer: Path, overrides: list[str]) -> list[str]:
    return [
        f"run.dir={work / 'runs'}",
        "run.id=demo",
        f"data.prefix={data_prefix}",
        "data.tokenizer=huggingface",
        f"data.tokenizer_path={tokenizer}",
        "data.split=95,5,0",
        "eval.interval=40",
        "eval.iters=4",
        f"checkpoint.local.dir={work / 'ckpt-local'}",
        f"checkpoint.reshardable.dir={work / 'ckpt-reshardable'}",
        "checkpoint.reshardable.interval=40",
        # Tier 3 on the embedded default: the same object-store protocol in a directory.
        f"checkpoint.s3.uri=file://{work / 's3'}",
        "checkpoint.s3.poll_s=1",
        # One machine is one failure domain: replicate to the other rank anyway (development only).
        "checkpoint.replication.allow_same_domain=true",
        "train.steps=160",
        "optimizer.lr=0.002",  # a short run on real text: learn fast enough to show in 160 steps
        "checkpoint.local.interval=10",
        # Tier 0: every step into memory, so the kill below loses 0 or 1 steps (tier 1 alone: 6).
        "checkpoint.memory.enabled=true",
        f"checkpoint.memory.dir={memory_dir(work)}",
        "fault_tolerance.inject.kill_rank=1",
        "fault_tolerance.inject.kill_at_step=97",
        *overrides,
    ]


def _train_with_uploader(work: Path, cfg_path: Path, cmd: list[str], env: dict[str, str]) -> tuple[int, float]:
    """The training job under ft_launcher, the uploader beside it; (launcher exit code, wall seconds)."""
    upload_cmd = [sys.executable, "-m", "pretrain", "upload", "--config", str(cfg_path)]
    print(f"[demo] uploader running: {' '.join(upload_cmd)} --watch", flush=True)
    t0 = time.perf_counter()
    with open(work / "launcher.log", "w") as logf, open(work / "uploader.log", "w") as uplog:
        # The uploader is its own process, as in production: training never waits for the store.
        uploader = subprocess.Popen([*upload_cmd, "--watch"], stdout=subprocess.DEVNULL, stderr=uplog, env=env)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            if " pretrain: " in line or "fault injection" in line or "restarting" in line.lower():
                print("  " + line.rstrip(), flush=True)
        rc = proc.wait()
        wall = time.perf_counter() - t0
        uploader.terminate()
        uploader.wait(timeout=60)
    return rc, wall


def _validation(run_dir: Path) -> dict[int, tuple[float, str]]:
    """Validation loss by step (the newest evaluation of a step) with the attempt that made it."""
    out: dict[int, tuple[float, str]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "validation":
            out[row["step"]] = (row["loss"], row["attempt"])
    return out


def _promoted(work: Path) -> list[int]:
    steps = work / "s3" / "demo" / "steps"
    if not steps.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in steps.glob("step-*") if (p / "COMMITTED").is_file())


def run_demo(config: str | None, workdir: str, overrides: list[str]) -> int:
    work = Path(workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        return _demo(work, config, overrides)
    finally:
        shutil.rmtree(memory_dir(work), ignore_errors=True)  # tmpfs is memory: give it back


def _demo(work: Path, config: str | None, overrides: list[str]) -> int:
    shutil.rmtree(memory_dir(work), ignore_errors=True)  # a previous demo's slots are not this run's
    tokenizer, data_prefix = prepare(work, DEMO_MB, VOCAB)
    entropy = unigram_entropy(data_prefix)
    settings = _settings(work, data_prefix, tokenizer, overrides)
    cfg = load_config(config, settings)  # a bad override fails before any launch
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    ft_path = work / "ft.yaml"
    ft_path.write_text(yaml.safe_dump(FT_CONFIG))
    cmd = ft_launcher_command(cfg_path, nproc=2, ft_config=ft_path, max_restarts=3)
    print("[demo] " + " ".join(cmd), flush=True)
    # NVRx puts unix sockets under TMPDIR: keep the path short (AF_UNIX allows ~108 bytes).
    env = {**os.environ, "TMPDIR": tempfile.mkdtemp(prefix="rp-demo-", dir="/tmp"), "PYTHONWARNINGS": "ignore"}
    rc, wall = _train_with_uploader(work, cfg_path, cmd, env)
    upload_cmd = [sys.executable, "-m", "pretrain", "upload", "--config", str(cfg_path), "--once"]
    flush = subprocess.run(upload_cmd, capture_output=True, text=True, env=env)
    promoted = _promoted(work)
    report = summarize(work / "runs" / "demo")
    print()
    print(format_report(report))
    print(f"steps promoted to tier 3    : {promoted} ({work / 's3'}, uploader exit {flush.returncode})")
    validation = _validation(work / "runs" / "demo")
    for step, (loss, attempt) in sorted(validation.items()):
        print(f"validation loss, step {step:<5}: {loss:.3f} nats ({attempt})")
    print(f"unigram entropy of the data : {entropy:.3f} nats (a model that learnt only token frequencies)")
    print(f"wall time                   : {wall:.1f} s (launcher exit code {rc})")
    (work / "recovery-summary.json").write_text(
        json.dumps(
            {
                **report.to_dict(),
                "wall_seconds": wall,
                "launcher_exit_code": rc,
                "s3_steps": promoted,
                "validation_loss": {str(k): v[0] for k, v in sorted(validation.items())},
                "unigram_entropy": entropy,
            },
            indent=1,
        )
    )
    ok = (
        rc == 0
        and report.final_step == cfg.train.steps
        and len(report.recoveries) == 1
        and report.recoveries[0].restored_step is not None
        and (not cfg.checkpoint.memory.enabled or report.recoveries[0].lost_steps <= 1)
        and cfg.train.steps in promoted
        and bool(validation)
        and validation[max(validation)][0] < entropy
    )
    print(f"[demo] {'OK' if ok else 'FAILED'}: logs in {work}")
    return 0 if ok else 1
