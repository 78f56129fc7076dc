"""The start-up check of the reshardable tier's storage, on two real gloo ranks in this machine.

Each rank is given the directory it would see as ``<checkpoint.reshardable.dir>/<run.id>``: the
same one (shared storage) or one of its own (node-local storage, as on two nodes with scratch).
The end-to-end case, two network-namespace nodes under ft_launcher, is in test_cluster_faults.py.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest

from pretrain.checkpointing.shared_storage import PROBE_PREFIX, check_shared
from tests.cluster.job import metric_rows, node_local_mount, start_node, wait_exit
from tests.cluster.netns import Cluster, unavailable
from tests.helpers import overrides_for, two_gloo_ranks
from tiering.collective import TorchCollective


def _check(roots: list[str], rank: int, _out: Path) -> dict:
    """One rank's check of its directory: what it raised, if anything, is the result under test."""
    try:
        check_shared(Path(roots[rank]), "attempt-07", TorchCollective(), f"node-{rank}", wait_s=1.0)
    except Exception as exc:  # what each rank raised is the result under test
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    return {"ok": True}


def _run(tmp: Path, roots: list[Path]) -> list[dict]:
    return list(two_gloo_ranks(functools.partial(_check, [str(r) for r in roots]), tmp / "results"))


def test_ranks_that_share_the_directory_pass_and_the_probe_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "reshard" / "run"
    root.mkdir(parents=True)
    (root / f"{PROBE_PREFIX}attempt-03").write_text("left by a killed attempt")
    assert _run(tmp_path, [root, root]) == [{"ok": True}, {"ok": True}]
    assert list(root.iterdir()) == [], "the probe (and an older attempt's) must be gone"


def test_a_rank_with_node_local_storage_refuses_on_every_rank_naming_node_path_and_fix(tmp_path: Path) -> None:
    shared, local = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    results = _run(tmp_path, [shared, local])
    assert [r["ok"] for r in results] == [False, False]
    assert {r["type"] for r in results} == {"ConfigError"}  # a user error: the repeat-stop ends the job
    message = results[1]["message"]
    assert results[0]["message"] == message and "\n" not in message
    assert message.startswith("checkpoint.reshardable.dir: rank 1 on node node-1 cannot see the probe file")
    assert f"rank 0 on node node-0 wrote in {local}:" in message and "attempt-07" not in message
    assert "fix: mount one shared filesystem" in message
    assert not (shared / f"{PROBE_PREFIX}attempt-07").exists()


def test_a_directory_rank_0_cannot_create_refuses_with_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "reshard"
    blocker.write_text("a file where the tier's directory should be")
    results = _run(tmp_path, [blocker / "run", blocker / "run"])
    assert [r["type"] for r in results] == ["ConfigError", "ConfigError"]
    assert results[0]["message"] == results[1]["message"]
    prefix = f"checkpoint.reshardable.dir: rank 0 on node node-0 cannot write {blocker}/run/"
    assert results[0]["message"].startswith(prefix), results[0]["message"]
    assert "fix: make" in results[0]["message"]


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))
def test_a_job_whose_reshardable_dir_is_node_local_refuses_at_start_and_stops(tmp_path: Path, corpus: Path) -> None:
    """Two network-namespace nodes under ft_launcher; on node 1 the reshardable directory is a
    node-local one mounted at the same path. The job must stop at start with the one line, not
    train until its first reshardable save (step 10 here) and fail there at every restart."""
    work = tmp_path / "work"
    reshard = work / "reshard"
    skip = ("checkpoint.local.dir", "run.id")  # pretrain launch sets them from LOCAL_NVME / RUN_ID
    over = [
        o
        for o in overrides_for(work, corpus, **{"train.steps": 40, "checkpoint.reshardable.interval": 10})
        if not o.startswith(skip)
    ]
    with Cluster(tmp_path / "cluster", 2) as cluster:
        local = node_local_mount(tmp_path / "node1-scratch", reshard)
        started = time.monotonic()
        procs = {0: start_node(cluster, 0, over), 1: start_node(cluster, 1, over, prefix=local)}
        codes = wait_exit(procs, timeout=420)
        took = time.monotonic() - started
    logs = "\n".join((tmp_path / "cluster" / f"node-{i}.log").read_text()[-2000:] for i in (0, 1))
    assert None not in codes.values() and 0 not in codes.values(), (codes, logs)
    run_dir = work / "runs" / "t"
    assert metric_rows(run_dir) == [], "no training step may run on storage that is not shared"
    stop = json.loads((run_dir / "attempts" / "STOP.json").read_text())
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]
    assert len(records) == 2, records  # the user error is retried once, then confirmed and stopped
    for rec in records:
        failure = rec["failure"]
        assert failure["classification"] == "user", failure
        line = failure["exception"]
        assert "checkpoint.reshardable.dir: rank 1 on node pretrain-1 cannot see the probe file" in line, line
        assert f"wrote in {reshard}/t:" in line and f"fix: mount one shared filesystem at {reshard} " in line, line
    assert "cannot see" in json.dumps(stop), stop
    print(f"node-local reshardable dir refused and stopped in {took:.1f}s (two attempts)")
