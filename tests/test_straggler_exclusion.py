"""A persistent straggler is left out: two network-namespace nodes (real ``pretrain launch`` per node,
c10d over a bridge, ``fault_tolerance.straggler.action: restart_without``), node 1's rank capped
from outside at ``CAP_CPU`` of a CPU after its first step (``tests/cpu_throttle.py``).

* Excluded: ``excluded-nodes.jsonl`` in the run directory names the capped node ``pretrain-1``
  (only it, never the clean ``pretrain-0``) after the cap began, with ``PATIENCE`` consecutive
  reports as evidence, each scoring rank 1 below ``THRESHOLD``; the attempt ended at the report
  that decided. Which report that is, is not asserted: on a quiet host it is ``PATIENCE *
  INTERVAL`` steps after the cap's first full interval, but a report a noisy host spoils starts
  the count again (at load 40 on 2 cores the unthrottled rank's own forward slowed 3-7x for single
  reports, measured), and a clean rank a noisy report names is no failure as long as it is not
  excluded. Which report excludes after which scores: ``test_straggler_action`` (in one process).
* Every rank ended the attempt with the class ``straggler`` ("straggler excluded: node
  pretrain-1"), the attempt record says ``excluded``, and both launchers exited.
* ``pretrain launch`` on that node refuses in one line naming the node, the file and the fix.
* The job resumes on the one node left (NNODES=1) through the reshardable tier (saved at world size
  2) and trains to the end; its losses equal those of a run started on one node within
  ``LOSS_RTOL`` (dropout off: the only difference is the fp32 summation order of 2 ranks x 1
  micro-batch instead of 1 x 2, ~1e-7 relative as ``test_cluster_faults`` measured; a skipped or
  repeated batch moves the loss by 1e-2 or more).

A run nobody slows reports nothing and excludes no node: ``test_stragglers``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pretrain.resilience.phases import ranks_in_phase
from tests.cluster.job import FT_CLUSTER, metric_rows, start_node, wait_exit
from tests.cluster.netns import Cluster, unavailable
from tests.cpu_throttle import CpuCap
from tests.helpers import TINY, events, job_env, metrics_by_step, overrides_for, torchrun_prefix

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))]

STEPS = 50
INTERVAL = 2
PATIENCE = 3  # one noisy report on a loaded host must not exclude a node
THRESHOLD = 0.3  # a loaded 2-core host: see test_stragglers
THROTTLE_AFTER = 1  # steps
# A fixed cap that binds on any host: far below what a rank gets on this shared 2-core host
# (0.03-0.2 CPU measured at load 30-40; there a rank nobody slows scored 0.15-0.4 for several
# reports in a row while the other was starved), and, as 1 ms of CPU per 50 ms period
# (tests/cpu_throttle.py), far below what a forward needs between two all-reduce waits on a fast
# host (a 50 % quota let short forwards run at full speed there: test_stragglers). bench/ measures
# half speed. A clean run naming nobody: test_stragglers.
CAP_CPU = 0.02
SAVE_EVERY = 4
LOSS_RTOL = 1e-4
COMMON = {
    "train.steps": STEPS,
    "data.global_batch_size": 8,
    "schedule.decay_steps": STEPS,
    "model.hidden_dropout": 0.0,
    "model.attention_dropout": 0.0,
    "checkpoint.local.interval": SAVE_EVERY,
    "checkpoint.reshardable.interval": SAVE_EVERY,
    "checkpoint.replication.timeout_s": 10,
}
STRAGGLER = {
    "fault_tolerance.straggler.report_interval": INTERVAL,
    "fault_tolerance.straggler.patience": PATIENCE,
    "fault_tolerance.straggler.threshold": THRESHOLD,
    "fault_tolerance.straggler.action": "restart_without",
}


def _job_overrides(work: Path, corpus: Path) -> list[str]:
    skip = ("checkpoint.local.dir", "run.id")  # pretrain launch sets them from LOCAL_NVME / RUN_ID
    extra = {**COMMON, **STRAGGLER, "checkpoint.replication.allow_same_domain": "false"}
    return [o for o in overrides_for(work, corpus, **extra) if not o.startswith(skip)]


def _start_baseline(base: Path, corpus: Path) -> subprocess.Popen[str]:
    """The run started on one node (1 rank), in the background while the cluster job runs."""
    cmd = [*torchrun_prefix(1), "-m", "pretrain", "train", "--config", str(TINY)]
    for item in overrides_for(base, corpus, **COMMON, **{"fault_tolerance.straggler.enabled": "false"}):
        cmd += ["--set", item]
    base.mkdir(parents=True)
    log = open(base / "job.log", "w")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=job_env(base), cwd=base)


def _cap(run_dir: Path, work: Path) -> CpuCap:
    def rank_1() -> int | None:
        return (ranks_in_phase(run_dir, None, "training", [1]) or {}).get(1)

    def step() -> int:
        return max((r["step"] for r in metric_rows(run_dir)), default=0)

    def excluded() -> bool:  # released then: a rank at 2 % of a CPU takes minutes to exit
        return (run_dir / "excluded-nodes.jsonl").exists()

    record = work / "throttle.json"
    return CpuCap(rank_1, step, THROTTLE_AFTER, record, measure_s=0.5, cap=CAP_CPU, until=excluded)


def ft_config(work: Path) -> Path:
    """tests/cluster/ft-cluster.yaml with a heartbeat timeout a rank at a few per cent of a CPU meets,
    even in its step with a save: 38 s on an idle host, 90 s in a full suite at load 10 (measured;
    at 60 s the rank was restarted uncapped there before its third report, and nothing was excluded)."""
    path = work / "ft-slow.yaml"
    path.write_text(FT_CLUSTER.read_text().replace("rank_heartbeat_timeout: 8.0", "rank_heartbeat_timeout: 180.0"))
    return path


def _run_until_excluded(cluster: Cluster, work: Path, corpus: Path, run_dir: Path) -> dict:
    over = _job_overrides(work, corpus)
    slow = _cap(run_dir, work)
    slow.start()
    try:
        ft = ft_config(work)
        procs = {i: start_node(cluster, i, over, max_restarts=2, ft_config=ft) for i in range(2)}
        codes = wait_exit(procs, timeout=600)
    finally:
        slow.stop.set()
        slow.join(timeout=30)
    assert slow.error is None and slow.done, (slow.error, slow.done)
    assert not Path(slow.done["cgroup"]).exists()
    assert None not in codes.values() and 0 not in codes.values(), (codes, (work / "node-0.log").read_text()[-3000:])
    return slow.done


def _check_exclusion(run_dir: Path, throttled_at: int) -> int:
    """The exclusion: which node, on what evidence, how the attempt ended. Returns its step."""
    lines = (run_dir / "excluded-nodes.jsonl").read_text().splitlines()
    (record,) = [json.loads(line) for line in lines]  # the capped node only: the clean one stays in
    assert record["node"] == "pretrain-1" and record["ranks"] == [1], record
    step = record["step"]
    evidence = record["reports"]
    assert [r["step"] for r in evidence] == list(range(step - (PATIENCE - 1) * INTERVAL, step + 1, INTERVAL)), record
    assert all(r["relative"]["1"] < THRESHOLD for r in evidence), record
    assert evidence[0]["step"] > throttled_at, ("judged on a report from before the cap", record, throttled_at)
    reports = [e for e in events(run_dir) if e["event"] == "straggler_report"]
    named = {r["step"] for r in reports if "pretrain-1" in r["slow_nodes"]}
    assert {r["step"] for r in evidence} <= named, (record, reports)
    assert reports[-1]["step"] == step, ("the attempt ends at the report that decided", record, reports)
    attempts = [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]
    first = attempts[0]
    assert first["status"] == "excluded" and first["excluded_node"] == "pretrain-1", first
    assert first["failure"]["classification"] == "straggler", first["failure"]
    assert first["failure"]["exception"].startswith(f"straggler excluded: node pretrain-1 at step {step}")
    reasons = [
        json.loads(p.read_text()) for p in (run_dir / "attempts" / "failures").glob(f"{first['id']}.rank-*.json")
    ]
    assert sorted(r["classification"] for r in reasons) == ["straggler", "straggler"], reasons
    return step


@pytest.mark.slow  # a job of a minute: make test runs it, make test-fast leaves it out
def test_a_node_slowed_from_outside_is_excluded_and_the_job_resumes_on_the_rest(tmp_path: Path, corpus: Path) -> None:
    base = tmp_path / "baseline"
    baseline = _start_baseline(base, corpus)
    work = tmp_path / "cluster"
    run_dir = work / "runs" / "t"
    try:
        with Cluster(work, 2) as cluster:
            throttle = _run_until_excluded(cluster, work, corpus, run_dir)
            excluded_at = _check_exclusion(run_dir, throttle["step"])
            over = _job_overrides(work, corpus)
            refused = wait_exit({1: start_node(cluster, 1, over, log_dir=tmp_path)}, timeout=120)
            alone = [*over, "checkpoint.replication.factor=1"]  # one node holds no peer replica
            resumed = wait_exit({0: start_node(cluster, 0, alone, nnodes=1, log_dir=tmp_path)}, timeout=480)
        assert baseline.wait(timeout=300) == 0, (base / "job.log").read_text()[-3000:]
    finally:
        if baseline.poll() is None:
            baseline.kill()
    assert refused == {1: 3}, refused
    (line,) = [x for x in (tmp_path / "node-1.log").read_text().splitlines() if x.startswith("launch refused")]
    assert "node pretrain-1 is excluded" in line and str(run_dir / "excluded-nodes.jsonl") in line and "fix:" in line
    assert resumed == {0: 0}, (tmp_path / "node-0.log").read_text()[-3000:]
    restore = [e for e in events(run_dir) if e["event"] == "restore"]
    newest = excluded_at - excluded_at % SAVE_EVERY
    assert [(r["step"], r["tier"]) for r in restore] == [(newest, "reshardable")], restore
    attempts = [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]
    assert attempts[-1]["status"] == "succeeded" and attempts[-1]["scaled"]["to_nodes"] == 1, attempts[-1]
    b, r = metrics_by_step(base / "runs" / "t"), metrics_by_step(run_dir)
    assert sorted(r) == list(range(1, STEPS + 1)) and [r[s]["consumed_samples"] for s in r] == [8 * s for s in r]
    worst = max(abs(r[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in r)
    assert worst < LOSS_RTOL, f"training after the exclusion drifted from the 1-node run: {worst:.2e}"
    print(
        "STRAGGLER_EXCLUSION",
        json.dumps({"throttled_at": throttle["step"], "excluded_at": excluded_at, "worst": worst}),
    )
