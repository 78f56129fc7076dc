"""A node of a 3-node cluster (network namespaces, real ``pretrain launch`` per node, c10d over a
bridge) is lost: its link goes down, its processes are SIGKILLed, its disk is wiped. A replacement
(new namespace, same hostname and node rank) joins with a stale NVMe directory from another run;
the job restores the newest step from the peer replicas, never the stale copies, and continues
bit-exactly against an uninterrupted baseline."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.job import metric_rows, start_node, wait_exit, wait_metric_step
from tests.cluster.netns import Cluster
from tests.helpers import events, metrics_by_step, overrides_for, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

STEPS = 40
COMMON = {
    "train.steps": STEPS,
    "checkpoint.local.interval": 10,
    "checkpoint.reshardable.interval": 1000,
    "data.global_batch_size": 12,  # divisible by 3 and by 2 ranks x micro-batch 2
    "checkpoint.replication.timeout_s": 10,
}
FAULT_AFTER = 23  # the node is lost once the job has finished this step (the newest step is 20)


def _job_overrides(work: Path, corpus: Path) -> list[str]:
    skip = ("checkpoint.local.dir", "run.id")  # pretrain launch sets them from LOCAL_NVME / RUN_ID
    over = overrides_for(work, corpus, **COMMON, **{"checkpoint.replication.allow_same_domain": "false"})
    return [o for o in over if not o.startswith(skip)]


def _plant_stale_disk(nvme: Path, baseline: Path) -> list[Path]:
    """The replacement's disk holds rank 2's steps of another run (run id 'base'), filed under this run's id."""
    stale = nvme / "t" / "ranks" / "rank-00002"
    shutil.copytree(baseline / "ckpt" / "base" / "ranks" / "rank-00002", stale)
    return sorted((stale / "steps").iterdir())


def test_node_loss_with_replacement_restores_from_peers_bit_exact(tmp_path: Path, corpus: Path) -> None:
    base = tmp_path / "baseline"
    over = overrides_for(base, corpus, **COMMON, **{"checkpoint.replication.allow_same_domain": "true"})
    torchrun(base, 3, [*over, "run.id=base"], timeout=300)
    work = tmp_path / "cluster"
    run_dir = work / "runs" / "t"
    over = _job_overrides(work, corpus)
    with Cluster(work, 3) as cluster:
        procs = {i: start_node(cluster, i, over) for i in range(3)}
        wait_metric_step(run_dir, FAULT_AFTER, list(procs.values()))
        fault = time.time()
        cluster.link(2, up=False)  # the node's network goes first, then the machine
        cluster.kill(2)
        cluster.remove(2)  # its NVMe directory is wiped with it
        last_before = max(r["step"] for r in metric_rows(run_dir))
        node = cluster.add(2)
        stale = _plant_stale_disk(node.nvme, base)
        procs[2] = start_node(cluster, 2, over)
        codes = wait_exit(procs, timeout=300)
    logs = {i: (work / f"node-{i}.log").read_text()[-3000:] for i in range(3)}
    assert codes == {0: 0, 1: 0, 2: 0}, logs
    ev = events(run_dir)
    restore = [e for e in ev if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restore] == [(20, "peer")]
    rows = {row["rank"]: row for row in restore[0]["per_rank"]}
    assert [rows[r]["tier"] for r in range(3)] == ["local", "local", "peer"], rows
    assert rows[2]["source"].startswith(("pretrain-0:replica", "pretrain-1:replica")), rows[2]
    assert {s.name for s in stale} >= {"step-000000020", "step-000000030"}, "stale steps newer than the restore"
    reasons = [x["reason"] for x in restore[0]["rejected"] if x["step"] == 20]
    assert reasons and "manifest belongs to run 'base', not 't'" in reasons[0], restore[0]["rejected"]
    b = metrics_by_step(base / "runs" / "base")
    r = metrics_by_step(run_dir)
    assert sorted(r) == list(range(1, STEPS + 1))
    for step in range(21, STEPS + 1):
        assert (r[step]["loss"], r[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    next_step = min((m for m in metric_rows(run_dir) if m["time"] > fault), key=lambda m: m["time"])
    numbers: dict[str, Any] = {
        "fault_to_next_step_s": round(next_step["time"] - fault, 2),
        "restored_step": restore[0]["step"],
        "lost_steps": last_before - restore[0]["step"],
        "restore_s": round(restore[0]["seconds"], 3),
    }
    print("NODE_LOSS", json.dumps(numbers))
    assert next_step["step"] == 21
