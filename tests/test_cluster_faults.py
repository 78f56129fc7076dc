"""One 3-node job on a cluster of network namespaces (real ``pretrain launch`` per node, c10d over a
bridge) goes through a partition and a node loss, and ends bit-exact against an uninterrupted run.

1. Partition: node 1's switch port goes down while its rank keeps running. The other ranks are
   killed by their heartbeat timeout (``tests/cluster/ft-cluster.yaml``: 8 s) and wait in the
   rendezvous; the partitioned rank, blocked in a collective, commits no tier-1 step and sends no
   replica (every commit and replica needs its peers): not one byte under any node's disk or the
   staging tier changes until the link heals. Then node 1 rejoins a new attempt, which restores
   the newest step every rank committed before the partition.
2. Node loss with a replacement: node 2's link goes down, its processes are SIGKILLed, its disk is
   wiped; a replacement (new namespace, same hostname and node rank) comes up with a stale NVMe
   directory from another run. The job restores the newest step from the peer replicas, never the
   stale copies (run id check), and continues.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from pretrain.resilience.phases import read_phases
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
PARTITION_AFTER = 13  # node 1 is cut off once the job finished this step (the newest step is 10)
LOSS_AFTER = 23  # node 2 is lost once the job finished this step (the newest step is 20)
HEARTBEAT_S = 8.0  # rank_heartbeat_timeout of tests/cluster/ft-cluster.yaml
HOLD_S = 14.0  # how long the partition lasts


def _job_overrides(work: Path, corpus: Path) -> list[str]:
    skip = ("checkpoint.local.dir", "run.id")  # pretrain launch sets them from LOCAL_NVME / RUN_ID
    over = overrides_for(work, corpus, **COMMON, **{"checkpoint.replication.allow_same_domain": "false"})
    return [o for o in over if not o.startswith(skip)]


def _files(roots: list[Path]) -> dict[str, tuple[int, int]]:
    out = {}
    for root in roots:
        for path in root.rglob("*") if root.exists() else []:
            if path.is_file():
                st = path.stat()
                out[str(path)] = (st.st_mtime_ns, st.st_size)
    return out


def _partition(cluster: Cluster, run_dir: Path, roots: list[Path]) -> dict[str, Any]:
    """Cut node 1 off; wait until the others' ranks are gone; hold; heal. What happened, measured."""
    pids = {rank: rec["pid"] for rank, rec in read_phases(run_dir).items()}
    before = _files(roots)
    cut = time.time()
    cluster.link(1, up=False)
    gone: dict[int, float] = {}
    while len(gone) < 2 and time.time() - cut < HEARTBEAT_S + 30:
        gone |= {r: time.time() - cut for r in (0, 2) if r not in gone and not os.path.exists(f"/proc/{pids[r]}")}
        time.sleep(0.05)
    time.sleep(max(0.0, cut + HOLD_S - time.time()))
    fenced_alive = os.path.exists(f"/proc/{pids[1]}")
    after = _files(roots)
    cluster.link(1, up=True)
    changed = {p: v for p, v in after.items() if before.get(p) != v}
    return {"detect_s": gone, "fenced_alive": fenced_alive, "changed": changed, "cut": cut}


def _lose_node(cluster: Cluster, base: Path) -> tuple[float, list[str]]:
    """Node 2's link goes down, its processes die, its disk is wiped; a replacement comes up with a
    stale disk: rank 2's steps of another run (run id 'base') filed under this run's id."""
    fault = time.time()
    cluster.link(2, up=False)
    cluster.kill(2)
    cluster.remove(2)
    node = cluster.add(2)
    stale = node.nvme / "t" / "ranks" / "rank-00002"
    shutil.copytree(base / "ckpt" / "base" / "ranks" / "rank-00002", stale)
    return fault, sorted(p.name for p in (stale / "steps").iterdir())


def test_partition_then_node_loss_with_replacement_bit_exact(tmp_path: Path, corpus: Path) -> None:
    base = tmp_path / "baseline"
    over = overrides_for(base, corpus, **COMMON, **{"checkpoint.replication.allow_same_domain": "true"})
    torchrun(base, 3, [*over, "run.id=base"], timeout=300)
    work = tmp_path / "cluster"
    run_dir = work / "runs" / "t"
    over = _job_overrides(work, corpus)
    with Cluster(work, 3) as cluster:
        procs = {i: start_node(cluster, i, over, max_restarts=3) for i in range(3)}
        wait_metric_step(run_dir, PARTITION_AFTER, list(procs.values()))
        last_before_cut = max(r["step"] for r in metric_rows(run_dir))
        roots = [work / f"nvme-{i}" for i in range(3)] + [work / "reshard"]
        part = _partition(cluster, run_dir, roots)
        wait_metric_step(run_dir, LOSS_AFTER, list(procs.values()))
        last_before_loss = max(r["step"] for r in metric_rows(run_dir))
        fault, stale = _lose_node(cluster, base)
        procs[2] = start_node(cluster, 2, over, max_restarts=3)
        codes = wait_exit(procs, timeout=300)
    logs = {i: (work / f"node-{i}.log").read_text()[-3000:] for i in range(3)}
    assert codes == {0: 0, 1: 0, 2: 0}, logs

    # The partition: detected within the heartbeat timeout; the cut-off rank lived on and wrote nothing.
    assert sorted(part["detect_s"]) == [0, 2] and max(part["detect_s"].values()) < HEARTBEAT_S + 5, part["detect_s"]
    assert part["fenced_alive"], "the partitioned rank must still be running when the link heals"
    assert part["changed"] == {}, f"written during the partition: {sorted(part['changed'])}"
    ev = events(run_dir)
    restore = [e for e in ev if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restore] == [(10, "local"), (20, "peer")], restore
    assert len({e["attempt"] for e in ev if e["event"] == "start"}) == 3

    # The node loss: rank 2 from a peer's replica, the stale disk rejected by its run id.
    rows = {row["rank"]: row for row in restore[1]["per_rank"]}
    assert [rows[r]["tier"] for r in range(3)] == ["local", "local", "peer"], rows
    assert rows[2]["source"].startswith(("pretrain-0:replica", "pretrain-1:replica")), rows[2]
    assert {"step-000000020", "step-000000030"} <= set(stale), "stale steps as new as the restore and newer"
    reasons = [x["reason"] for x in restore[1]["rejected"] if x["step"] == 20]
    assert reasons and "manifest belongs to run 'base', not 't'" in reasons[0], restore[1]["rejected"]

    b = metrics_by_step(base / "runs" / "base")
    r = metrics_by_step(run_dir)
    assert sorted(r) == list(range(1, STEPS + 1))
    for step in range(11, STEPS + 1):
        assert (r[step]["loss"], r[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    after_loss = min((m for m in metric_rows(run_dir) if m["time"] > fault), key=lambda m: m["time"])
    assert after_loss["step"] == 21
    numbers = {
        "partition_detect_s": {str(k): round(v, 2) for k, v in part["detect_s"].items()},
        "partition_lost_steps": last_before_cut - restore[0]["step"],
        "fenced_bytes_written": sum(size for _, size in part["changed"].values()),
        "node_loss_fault_to_next_step_s": round(after_loss["time"] - fault, 2),
        "node_loss_lost_steps": last_before_loss - restore[1]["step"],
    }
    print("CLUSTER_FAULTS", json.dumps(numbers))
