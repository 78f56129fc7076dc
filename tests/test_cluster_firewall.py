"""The Slurm job firewall (slurm/prolog.sh, slurm/epilog.sh, slurm/job-firewall.sh) applied for
real with nftables on a cluster of network namespaces: the job is nodes 0 and 1, node 2 is a
namespace on the same bridge outside the job (another tenant's machine).

* The prolog runs in each job node's namespace exactly as Slurm would run it there (SLURM_JOB_ID,
  SLURM_JOB_NODELIST expanded by the real ``scontrol show hostnames``, each name resolved by
  ``getent`` through the node's own ``/etc/hosts``; the slurmctld host read from SLURM_CONF), and
  loads its table into the node's own nf_tables.
* Reachability is measured with real connections (:mod:`tests.cluster.ports`): from node 2 the
  job's ports (rendezvous, metrics, the ephemeral range its gloo groups listen in) time out and the
  table's drop counter counts them, while a port outside them still answers; from node 1 they
  answer. A multi-node job trains to its last step and replicates every tier-1 step through it.
* The epilog deletes exactly its job's table; another job's table on the node stays.

Everything lives in the cluster's namespaces (their nf_tables go with them), removed by the
cluster's close even when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.cluster.job import RDZV_PORT, start_node, wait_exit, wait_metric_step
from tests.cluster.netns import Cluster, unavailable
from tests.helpers import PYTHON, REPO, events, metrics_by_step, overrides_for


def _why_skip() -> str | None:
    if reason := unavailable():
        return reason
    if not shutil.which("nft"):
        return "nft is not installed; fix: scripts/install-system-deps.sh (apt-get install nftables)"
    return None


pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(_why_skip()), reason=str(_why_skip()))]

PORTS = REPO / "tests" / "cluster" / "ports.py"
JOB_NODES = "pretrain-[0-1]"
ROGUE = 2
DROP_WAIT_S = 3.0  # a dropped SYN answers nothing: the probe's connect gives up after this


def _slurm_files(tmp: Path) -> dict[str, str]:
    """A node's Slurm settings: slurm.conf naming the controller ``gateway`` (the host's end of the
    bridge) and an empty site file, so the script's defaults are what is tested."""
    conf, site = tmp / "slurm.conf", tmp / "job-firewall.conf"
    conf.write_text(
        "ClusterName=netns\nSlurmctldHost=gateway\n"
        "NodeName=pretrain-[0-2] CPUs=1\nPartitionName=d Nodes=pretrain-[0-2]\n"
    )
    site.write_text("# the defaults of slurm/job-firewall.sh\n")
    return {"SLURM_CONF": str(conf), "JOB_FIREWALL_CONF": str(site), "NODE_STATE_DIR": str(tmp / "no-markers")}


def _slurm_script(cluster: Cluster, index: int, script: str, env: dict[str, str]) -> str:
    """slurm/<script> on node ``index``, as root in the node's namespace; its output."""
    argv = ["env", *(f"{k}={v}" for k, v in env.items()), str(REPO / "slurm" / script)]
    out = cluster.run(index, argv)
    assert out.returncode == 0, f"{script} on node {index}: {out.stdout} {out.stderr}"
    return out.stdout + out.stderr


def _prolog(cluster: Cluster, files: dict[str, str], job: int, nodelist: str, nodes: list[int]) -> None:
    env = {**files, "SLURM_JOB_ID": str(job), "SLURM_JOB_NODELIST": nodelist}
    for index in nodes:
        assert f"table inet rp_job_{job} loaded" in _slurm_script(cluster, index, "prolog.sh", env)


def _epilog(cluster: Cluster, files: dict[str, str], job: int, nodes: list[int]) -> None:
    for index in nodes:
        out = _slurm_script(cluster, index, "epilog.sh", {**files, "SLURM_JOB_ID": str(job)})
        assert f"table inet rp_job_{job} deleted" in out, out


def _tables(cluster: Cluster, index: int) -> list[str]:
    out = cluster.run(index, ["nft", "list", "tables"])
    assert out.returncode == 0, out.stderr
    return sorted(line.split()[-1] for line in out.stdout.splitlines())


def _in_set(cluster: Cluster, index: int, job: int, addr: str) -> bool:
    """Whether the job's table on node ``index`` lets ``addr`` in (nft's own set lookup)."""
    out = cluster.run(index, ["nft", "get", "element", "inet", f"rp_job_{job}", "nodes4", "{", addr, "}"])
    return out.returncode == 0


def _dropped(cluster: Cluster, index: int, job: int) -> int:
    out = cluster.run(index, ["nft", "list", "table", "inet", f"rp_job_{job}"]).stdout
    (packets,) = re.findall(r"counter packets (\d+) bytes \d+ drop", out)
    return int(packets)


def _probe(cluster: Cluster, src: int, dst: int, ports: list[int]) -> dict[int, str]:
    """Connect from node ``src`` to each of node ``dst``'s ``ports`` at once: port -> outcome."""
    argv = [PYTHON, str(PORTS), "connect", cluster.node_name(dst), str(DROP_WAIT_S), *map(str, ports)]
    out = cluster.run(src, argv, timeout=DROP_WAIT_S + 60)
    assert out.returncode == 0, out.stderr
    return {int(port): outcome for port, (outcome, _seconds) in json.loads(out.stdout).items()}


def _listen(cluster: Cluster, index: int, ports: list[int], work: Path) -> None:
    ready = work / f"listening-{index}"
    argv = [PYTHON, str(PORTS), "listen", str(ready), *map(str, ports)]
    cluster.popen(index, argv, dict(os.environ), work / "listen.log")
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, (work / "listen.log").read_text()
        time.sleep(0.05)


def test_only_the_jobs_nodes_reach_its_ports_and_the_epilog_removes_only_its_table(tmp_path: Path) -> None:
    files = _slurm_files(tmp_path)
    # 29400: a rendezvous port (the cluster's RDZV_PORT); 9400: metrics; 45000: the ephemeral range
    # (gloo); 8080: none of the job's ports.
    ports = [RDZV_PORT, 9400, 45000, 8080]
    with Cluster(tmp_path / "cluster", 3) as cluster:
        _listen(cluster, 0, ports, tmp_path)
        before = _probe(cluster, ROGUE, 0, ports)
        assert before == dict.fromkeys(ports, "connected"), before  # the bridge itself lets it through
        _prolog(cluster, files, 4401, JOB_NODES, [0, 1])
        _prolog(cluster, files, 4401, JOB_NODES, [0])  # a requeued job's prolog again: replaced, not doubled
        assert _tables(cluster, 0) == ["rp_job_4401"] and _tables(cluster, ROGUE) == []
        gateway = f"{cluster.subnet}.254"  # SlurmctldHost=gateway: slurmctld reaches srun's ports
        members = {a: _in_set(cluster, 0, 4401, a) for a in (cluster.address(0), cluster.address(1), gateway)}
        assert all(members.values()) and not _in_set(cluster, 0, 4401, cluster.address(ROGUE)), members

        rogue = _probe(cluster, ROGUE, 0, ports)
        assert rogue == {RDZV_PORT: "timeout", 9400: "timeout", 45000: "timeout", 8080: "connected"}, rogue
        assert _dropped(cluster, 0, 4401) >= 3  # the table, not the network, refused them
        member = _probe(cluster, 1, 0, ports)
        assert member == dict.fromkeys(ports, "connected"), member
        own = _probe(cluster, 0, 0, ports)  # its own name: the loopback path
        assert own == dict.fromkeys(ports, "connected"), own

        _prolog(cluster, files, 4402, "pretrain-0", [0])  # another job on node 0: its own table
        assert _tables(cluster, 0) == ["rp_job_4401", "rp_job_4402"]
        _epilog(cluster, files, 4401, [0, 1])
        assert _tables(cluster, 0) == ["rp_job_4402"] and _tables(cluster, 1) == []
        _epilog(cluster, files, 4402, [0])
        assert _tables(cluster, 0) == []
        after = _probe(cluster, ROGUE, 0, ports)
        assert after == dict.fromkeys(ports, "connected"), after


def test_a_bad_job_id_or_an_unresolvable_node_fails_the_prolog_in_one_line(tmp_path: Path) -> None:
    files = _slurm_files(tmp_path)
    with Cluster(tmp_path / "cluster", 1) as cluster:
        script = str(REPO / "slurm" / "prolog.sh")
        cases = {
            "1;flush ruleset": ("pretrain-0", "is not a job id; fix:"),
            "4403": ("pretrain-[0-9]", "node pretrain-1 of job 4403 does not resolve; fix:"),
        }
        for job, (nodelist, message) in cases.items():
            env = [f"{k}={v}" for k, v in {**files, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist}.items()]
            out = cluster.run(0, ["env", *env, script])
            assert out.returncode == 1 and message in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
        assert _tables(cluster, 0) == []  # nothing half-made


STEPS = 60
INTERVAL = 5


def _listening(cluster: Cluster, index: int) -> list[int]:
    out = cluster.run(index, ["ss", "-Hltn"])
    assert out.returncode == 0, out.stderr
    return sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in out.stdout.splitlines()})


def _ephemeral(cluster: Cluster, index: int) -> range:
    lo, hi = map(int, cluster.run(index, ["cat", "/proc/sys/net/ipv4/ip_local_port_range"]).stdout.split())
    return range(lo, hi + 1)


@pytest.mark.slow
def test_a_job_trains_and_replicates_through_its_firewall_and_no_one_else_reaches_its_ports(
    tmp_path: Path, corpus: Path
) -> None:
    files = _slurm_files(tmp_path)
    work = tmp_path / "cluster"
    run_dir = work / "runs" / "t"
    skip = ("checkpoint.local.dir", "run.id")  # pretrain launch sets them from LOCAL_NVME / RUN_ID
    extra = {
        "train.steps": STEPS,
        "schedule.decay_steps": STEPS,
        "checkpoint.local.interval": INTERVAL,
        "checkpoint.replication.allow_same_domain": "false",
        "checkpoint.replication.timeout_s": 10,
    }
    over = [o for o in overrides_for(work, corpus, **extra) if not o.startswith(skip)]
    with Cluster(work, 3) as cluster:
        _prolog(cluster, files, 4404, JOB_NODES, [0, 1])
        procs = {i: start_node(cluster, i, over, nnodes=2) for i in (0, 1)}
        wait_metric_step(run_dir, INTERVAL + 1, list(procs.values()), timeout=600)
        # The ports the job listens on now on node 0: the rendezvous store and its gloo groups'.
        ports = _listening(cluster, 0)
        gloo = [p for p in ports if p in _ephemeral(cluster, 0)]
        assert RDZV_PORT in ports and gloo, f"node 0 listens on {ports}: no rendezvous or no ephemeral port"
        rogue = _probe(cluster, ROGUE, 0, ports)
        still = set(_listening(cluster, 0))
        assert set(ports) <= still, f"ports {sorted(set(ports) - still)} closed while probed: the probe proves nothing"
        assert rogue == dict.fromkeys(ports, "timeout"), rogue
        dropped = _dropped(cluster, 0, 4404)
        assert dropped >= len(ports), dropped
        member = _probe(cluster, 1, 0, [RDZV_PORT])  # the store takes a stray connection; gloo's are the job's
        assert member == {RDZV_PORT: "connected"}, member
        codes = wait_exit(procs, timeout=600)
        assert codes == {0: 0, 1: 0}, (work / "node-0.log").read_text()[-3000:]
        # Each node holds the other's newest step (checked here: the disks go with the cluster).
        for holder, owner in ((0, 1), (1, 0)):
            replicas = cluster.nodes[holder].nvme / "t" / "replicas" / f"rank-{owner:05d}" / "steps"
            assert (replicas / f"step-{STEPS:09d}" / "COMMITTED").exists(), sorted(p.name for p in replicas.iterdir())
        _epilog(cluster, files, 4404, [0, 1])
        assert _tables(cluster, 0) == [] and _tables(cluster, 1) == []
    assert max(metrics_by_step(run_dir)) == STEPS
    saves = [e for e in events(run_dir) if e["event"] == "save" and e.get("tier") == "local"]
    assert [e["step"] for e in saves] == list(range(INTERVAL, STEPS + 1, INTERVAL)), saves
    assert all(e["under_replicated"] == [] for e in saves), [e for e in saves if e["under_replicated"]]
    print("CLUSTER_FIREWALL", {"rogue": rogue, "gloo_ports": gloo, "dropped_syns": dropped})
