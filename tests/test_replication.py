"""Tiers 1-2: per-rank local saves replicated across failure domains; recovery local -> peer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    PYTHON,
    arrived,
    events,
    flip_byte,
    ft_launch,
    metrics_by_step,
    overrides_for,
    torchrun,
    two_node_launch,
)
from tiering.errors import ReplicaRejected
from tiering.layout import RunLayout
from tiering.local.publish import publish_received
from tiering.peer.placement import PlacementError, RankIdentity, replica_holders
from tiering.verify import verify_step

STATE = "state.pt"


# -- placement --------------------------------------------------------------------------------


def test_placement_puts_every_replica_in_another_domain() -> None:
    ids = [RankIdentity(r, f"node-{r // 2}", f"rack-{r // 4}") for r in range(8)]  # 2 racks x 2 nodes x 2 ranks
    holders = replica_holders(ids, factor=2, allow_same_domain=False)
    domain = {i.rank: i.domain for i in ids}
    assert all(domain[h] != domain[o] for o, hs in holders.items() for h in hs)
    held = sorted(h for hs in holders.values() for h in hs)
    assert held == list(range(8)), "each rank holds exactly one replica: the load is balanced"
    assert holders == replica_holders(list(reversed(ids)), 2, False), "placement is deterministic"


def test_placement_factor_three_uses_three_domains() -> None:
    ids = [RankIdentity(r, f"n{r}", f"zone-{r % 3}") for r in range(6)]
    for owner, hs in replica_holders(ids, 3, False).items():
        assert len({ids[owner].domain, *(ids[h].domain for h in hs)}) == 3


def test_same_domain_placement_is_refused_naming_the_domains() -> None:
    ids = [RankIdentity(r, "host-a", "rack-1") for r in range(2)]
    with pytest.raises(PlacementError) as err:
        replica_holders(ids, 2, allow_same_domain=False)
    assert "found 1 (rack-1: ranks 0,1)" in str(err.value) and "allow_same_domain" in str(err.value)
    assert "\n" not in str(err.value)
    assert replica_holders(ids, 2, allow_same_domain=True) == {0: [1], 1: [0]}


# -- receiving a replica ----------------------------------------------------------------------


def _manifest(run: str, step: int, owner: int, data: bytes) -> bytes:
    body = {
        "schema_version": 1,
        "run_id": run,
        "step": step,
        "world_size": 2,
        "parallelism": {"tp": 1},
        "extra": {"owner_rank": owner},
        "files": [{"path": STATE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
    }
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("run", "step", "owner", "payload", "needle"),
    [
        ("other-run", 10, 1, b"abc", "belongs to run 'other-run'"),
        ("t", 20, 1, b"abc", "is for step 20, expected 10"),
        ("t", 10, 0, b"abc", "owned by rank 0, expected 1"),
        ("t", 10, 1, b"abd", "received SHA-256 does not match manifest"),
    ],
)
def test_replica_not_matching_its_manifest_is_rejected(
    tmp_path: Path, run: str, step: int, owner: int, payload: bytes, needle: str
) -> None:
    layout = RunLayout(tmp_path / "replicas", "rank-00001")
    with pytest.raises(ReplicaRejected, match=needle):
        publish_received(
            layout, arrived(layout, ("t", 10, 1), _manifest(run, step, owner, b"abc"), {STATE: payload}), "t", 10, 1
        )
    assert not layout.steps_dir.exists() or not any(layout.steps_dir.iterdir()), "nothing may be published"


def test_replica_matching_its_manifest_is_committed(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "replicas", "rank-00001")
    publish_received(layout, arrived(layout, ("t", 10, 1), _manifest("t", 10, 1, b"abc"), {STATE: b"abc"}), "t", 10, 1)
    manifest = verify_step(layout.step_dir(10), expect_run_id="t")
    assert manifest.extra["owner_rank"] == 1
    again = arrived(layout, ("t", 10, 1), _manifest("t", 10, 1, b"abc"), {STATE: b"abc"}, attempt="a2")
    publish_received(layout, again, "t", 10, 1)  # idempotent
    assert not again.directory.exists(), "the second copy is dropped"


# -- real multi-process runs ------------------------------------------------------------------


@pytest.mark.slow
def test_node_loss_recovers_from_replicas_bit_exact(tmp_path: Path, corpus: Path) -> None:
    """4 ranks on 2 simulated nodes in 2 domains; node-b's ranks are SIGKILLed and its local root
    deleted; the restarted job restores step 30 from replicas and matches an uninterrupted run."""
    # Killed at 37, restored at 30: ten steps after the restore prove it bit-exact (4 ranks on 2
    # cores: each step costs here).
    common = {"train.steps": 40, "checkpoint.local.interval": 10, "checkpoint.reshardable.interval": 1000}
    base = tmp_path / "baseline"
    torchrun(
        base,
        4,
        overrides_for(base, corpus, **common, **{"checkpoint.replication.allow_same_domain": "true"}),
        timeout=420,
    )

    job = tmp_path / "job"
    shared = [o for o in overrides_for(job, corpus, **common) if not o.startswith("checkpoint.local.dir")]
    first = two_node_launch(
        job,
        [*shared, "fault_tolerance.inject.kill_node=node-b", "fault_tolerance.inject.kill_at_step=37"],
        max_restarts=0,
    )
    assert all(p.returncode != 0 for p in first.values()), "without restarts left the job stops"
    killed = [e for e in events(job / "runs" / "t") if e["event"] == "fault_injected"]
    assert sorted(e["node"] for e in killed) == ["node-b", "node-b"]
    assert (job / "local-node-b" / "t" / "replicas").is_dir()
    shutil.rmtree(job / "local-node-b")  # the node is replaced: its NVMe is empty

    second = two_node_launch(job, shared, max_restarts=1)
    assert all(p.returncode == 0 for p in second.values()), second["node-a"].stdout[-3000:]
    restore = [e for e in events(job / "runs" / "t") if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restore] == [(30, "peer")]
    rows = restore[0]["per_rank"]
    assert sorted(r["tier"] for r in rows) == ["local", "local", "peer", "peer"]
    assert all("node-a:replica" in r["source"] for r in rows if r["tier"] == "peer")

    b = metrics_by_step(base / "runs" / "t")
    r = metrics_by_step(job / "runs" / "t")
    for step in range(31, 41):
        assert (r[step]["loss"], r[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    ls = subprocess.run(
        [PYTHON, "-m", "tiering", "ls", str(job / "local-node-a" / "t"), str(job / "local-node-b" / "t")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ls.returncode == 0 and "40" in ls.stdout


@pytest.mark.slow
def test_primary_and_replica_both_corrupt_falls_back_to_older_step(tmp_path: Path, corpus: Path) -> None:
    job = tmp_path / "job"
    ov = {"checkpoint.local.interval": 10, "checkpoint.reshardable.enabled": "false"}
    torchrun(job, 2, overrides_for(job, corpus, **ov, **{"train.steps": 20}))
    root = job / "ckpt" / "t"
    flip_byte(root / "ranks" / "rank-00001" / "steps" / "step-000000020" / STATE)
    os.truncate(root / "replicas" / "rank-00001" / "steps" / "step-000000020" / STATE, 100)
    torchrun(job, 2, overrides_for(job, corpus, **ov, **{"train.steps": 20}))
    restore = [e for e in events(job / "runs" / "t") if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restore] == [(10, "local")]
    reasons = " ".join(x["reason"] for x in restore[0]["rejected"])
    assert "ranks/rank-00001/steps/step-000000020/state.pt" in reasons
    assert "replicas/rank-00001/steps/step-000000020/state.pt" in reasons
    assert len(list(root.glob("*/rank-00001/quarantine/step-000000020.*.reason.txt"))) == 2
    assert min(metrics_by_step(job / "runs" / "t")[s]["step"] for s in range(11, 21)) == 11


@pytest.mark.slow
def test_peer_dying_during_replication_leaves_step_local_only(tmp_path: Path, corpus: Path) -> None:
    job = tmp_path / "job"
    ov = overrides_for(
        job,
        corpus,
        **{
            "train.steps": 15,
            "checkpoint.local.interval": 5,  # the killed replication (step 10) is not the first
            "checkpoint.reshardable.enabled": "false",
            "checkpoint.replication.timeout_s": 10,
            "fault_tolerance.inject.kill_during_replication_rank": 1,
            "fault_tolerance.inject.kill_at_step": 10,
        },
    )
    proc = ft_launch(job, 2, ov, timeout=300)
    ev = events(job / "runs" / "t")
    assert [(e["rank"], e.get("during")) for e in ev if e["event"] == "fault_injected"] == [(1, "replication")]
    assert "under-replicated" in proc.stdout + proc.stderr + (job / "job.log").read_text()
    restore = [e for e in ev if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restore] == [(10, "local")], "published primaries are complete"
    saves = [e for e in ev if e["event"] == "save" and e["step"] == 15]
    assert saves and saves[0]["under_replicated"] == [], "the next step replicates normally"
    ls = subprocess.run(
        [PYTHON, "-m", "tiering", "ls", str(job / "ckpt" / "t"), "--json"], capture_output=True, text=True, timeout=60
    )
    rows = {row["step"]: row for row in json.loads(ls.stdout)}
    assert rows[10]["under_replicated"] == [0] and rows[15]["under_replicated"] == []


@pytest.mark.slow
def test_job_refuses_to_start_when_replicas_would_share_a_domain(tmp_path: Path, corpus: Path) -> None:
    job = tmp_path / "job"
    proc = torchrun(
        job,
        2,
        overrides_for(job, corpus, **{"checkpoint.replication.allow_same_domain": "false"}),
        check=False,
        timeout=200,
    )
    assert proc.returncode != 0
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("config error:")]
    assert lines and "needs 2 failure domains, found 1" in lines[0] and "allow_same_domain" in lines[0]
    assert not (job / "ckpt").exists() or not list((job / "ckpt").rglob("state.pt"))
