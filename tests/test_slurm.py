"""slurm/pretrain.sbatch on a real one-node Slurm cluster: train, `scontrol requeue` mid-run, and
the requeued job resumes from the newest verified checkpoint and finishes."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pretrain.config import load_config
from tests.helpers import FT_CPU, REPO, TINY, job_env, overrides_for, read_jsonl

pytestmark = pytest.mark.slow


def _job_state(job: str, env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    state = re.search(r"JobState=(\S+)", out)
    restarts = re.search(r"Restarts=(\d+)", out)
    return (state.group(1) if state else "UNKNOWN"), int(restarts.group(1)) if restarts else 0


def _max_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return max((rec["step"] for rec in read_jsonl(metrics)), default=0)


def test_sbatch_requeue_resumes_from_the_newest_verified_step(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    steps = 240
    cfg = load_config(
        TINY,
        overrides_for(
            tmp_path,
            corpus,
            **{
                "train.steps": steps,
                "checkpoint.reshardable.interval": 1000,
                "fault_tolerance.emergency_save_timeout": 8,
            },
        ),
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    env = {
        **job_env(tmp_path),
        **{k: v for k, v in slurm_cluster.items() if k == "SLURM_CONF"},
        "CONFIG": str(config),
        "LOCAL_NVME": str(nvme),
        "NPROC_PER_NODE": "2",
        "MAX_RESTARTS": "1",
        "FT_CONFIG": str(FT_CPU),
        "PRETRAIN": str(REPO / ".venv" / "bin" / "pretrain"),
    }
    submit = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            f"--output={tmp_path}/slurm-%j.out",
            str(REPO / "slurm" / "pretrain.sbatch"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job}.out"
    run_dir = tmp_path / "runs" / "t"

    deadline = time.monotonic() + 180
    while _max_step(run_dir / "metrics.jsonl") < 25:
        assert time.monotonic() < deadline, (
            f"no progress: {_job_state(job, env)}\n{log.read_text()[-3000:] if log.exists() else ''}"
        )
        time.sleep(0.2)
    requeue = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, env=env)
    assert requeue.returncode == 0, requeue.stderr
    # Slurm holds a requeued job for 120 s before it is eligible again (users see that too); the
    # test makes it eligible at once when it is back in the queue.
    deadline = time.monotonic() + 120
    while _job_state(job, env)[0] != "PENDING":
        assert time.monotonic() < deadline, f"job {job} not requeued: {_job_state(job, env)}"
        time.sleep(0.2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)

    deadline = time.monotonic() + 300
    while True:
        state, restarts = _job_state(job, env)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        assert time.monotonic() < deadline, f"job {job} still {state}\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert restarts == 1, f"Slurm counted {restarts} requeues"
    assert "restart count 0" in text and "restart count 1" in text

    records = [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]
    assert [r.get("slurm_restart_count") for r in records] == [0, 1], records
    first, second = records
    assert first["status"] in ("preempted", "failed") and first["slurm_job_id"] == second["slurm_job_id"] == job
    assert second["status"] == "succeeded" and second["last_step"] == steps
    restored = second["restored"]
    assert restored is not None and restored["step"] > 0, "the requeued job must not start from step 0"
    # The newest verified step: the emergency step if it was published, else the last interval step.
    expected = first["last_step"] if first.get("emergency_published") else first["last_step"] // 10 * 10
    assert restored["step"] == expected, (first, second)
    assert second["lost_steps"] == first["last_step"] - restored["step"]
    assert _max_step(run_dir / "metrics.jsonl") == steps
