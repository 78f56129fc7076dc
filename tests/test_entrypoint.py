"""``pretrain launch`` in --dry-run with pod-like and Slurm-like environments, and its bad inputs."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pretrain.commands.launch import check_flags, expand_slurm_nodelist, first_slurm_host
from pretrain.errors import EXCLUDED_EXIT_CODE, STOP_EXIT_CODE, LaunchError
from pretrain.resilience.attempts import scaled_from
from tests.helpers import PYTHON, TINY

# 8 ranks per node on 1 to 4 nodes: a global batch that micro-batch 2 x every such dp divides.
FITS = ("--set", "data.global_batch_size=192")


def _launch(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "PYTHONWARNINGS": "ignore"}
    argv = [PYTHON, "-m", "pretrain", "launch", "--config", str(TINY), "--nproc-per-node", "8", "--dry-run"]
    return subprocess.run(
        [*argv, *FITS, *extra],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=120,
    )


def test_pod_environment(tmp_path: Path) -> None:
    out = _launch(
        {
            "HOSTNAME": "pretrain-3",
            "NNODES": "4",
            "RDZV_HOST": "pretrain-0.pretrain",
            "NODE_NAME": "ip-10-1",
            "FAILURE_DOMAIN": "us-east-1b",
            "LOCAL_NVME": str(tmp_path),
            "RUN_ID": "gpt-8b-001",
        }
    )
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout.splitlines()[-1])
    assert cmd[0].endswith("ft_launcher")
    assert {
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=pretrain-0.pretrain:29500",
        "--rdzv-id=gpt-8b-001",
        "--max-restarts=3",
    } <= set(cmd)
    assert "kubernetes: node 3/4" in out.stdout and "domain us-east-1b" in out.stdout
    assert cmd[cmd.index("-m") : cmd.index("-m") + 3] == ["-m", "pretrain", "train"]
    assert f"checkpoint.local.dir={tmp_path}" in cmd and "run.id=gpt-8b-001" in cmd


def test_slurm_environment(tmp_path: Path) -> None:
    out = _launch(
        {
            "SLURM_JOB_ID": "42",
            "SLURM_NNODES": "3",
            "SLURM_NODEID": "2",
            "SLURMD_NODENAME": "gpu005",
            "SLURM_JOB_NODELIST": "gpu[003-005]",
            "SLURM_RESTART_COUNT": "1",
            "LOCAL_NVME": str(tmp_path),
        }
    )
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout.splitlines()[-1])
    assert "--rdzv-endpoint=gpu003:29500" in cmd and "--nnodes=3" in cmd
    assert "slurm: node 2/3" in out.stdout and "restarts so far 1" in out.stdout


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"HOSTNAME": "trainer", "NNODES": "2"}, "has no StatefulSet ordinal"),
        ({"HOSTNAME": "pretrain-5", "NNODES": "4"}, "node rank 5 is not below the number of nodes 4"),
        ({"HOSTNAME": "pretrain-0"}, "NNODES is not set"),
        ({"HOSTNAME": "pretrain-0", "NNODES": "two"}, "NNODES='two' is not an integer"),
        ({"HOSTNAME": "pretrain-0", "NNODES": "1"}, "LOCAL_NVME is not set"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2"}, "SLURM_NODEID is not set"),
    ],
)
def test_bad_launch_environments_fail_in_one_line(env: dict[str, str], needle: str) -> None:
    out = _launch(env)
    assert out.returncode == 2
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and "fix:" in lines[0], out.stderr


def test_a_node_local_launch_error_exits_3_so_the_job_restarts_elsewhere(tmp_path: Path) -> None:
    """Exit 2 stops the run (JobSet FailJobSet, the sbatch ends the job); what is wrong with this
    node only (its NVMe, its topology file) exits 3: restart elsewhere."""
    missing = tmp_path / "nvme-not-assembled"
    out = _launch({"HOSTNAME": "pretrain-0", "NNODES": "1", "LOCAL_NVME": str(missing)})
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == EXCLUDED_EXIT_CODE == 3 and len(lines) == 1, out.stderr
    assert lines[0].startswith("launch error on this node: ") and "does not exist" in lines[0] and "fix:" in lines[0]
    gone = tmp_path / "no-topology"
    out = _launch(_slurm_env(tmp_path, TOPOLOGY_FILE=str(gone)))
    assert out.returncode == 3 and f"TOPOLOGY_FILE={gone}: cannot read it" in out.stderr, out.stderr
    # Run-level problems keep the stop code, whatever the node.
    assert _launch({"HOSTNAME": "pretrain-0"}).returncode == STOP_EXIT_CODE == 2
    assert (
        _launch({"HOSTNAME": "pretrain-0", "NNODES": "1", "LOCAL_NVME": str(tmp_path)}, "--set", "x.y=1").returncode
        == 2
    )


def test_unsupported_flag_fails_fast(tmp_path: Path) -> None:
    fake = tmp_path / "ft_launcher"
    fake.write_text("#!/bin/sh\necho '  --nnodes NNODES'\necho '  --max-restarts MAX_RESTARTS'\n")
    fake.chmod(0o755)
    with pytest.raises(LaunchError) as err:
        check_flags(str(fake), [str(fake), "--nnodes=2", "--max-restarts=3", "--rdzv-backend=c10d", "-m", "x"])
    assert "does not accept --rdzv-backend" in str(err.value)


def test_node_count_the_layout_cannot_divide_is_refused_naming_those_that_fit(tmp_path: Path) -> None:
    """A scale-down to 5 nodes of 8 ranks: a global batch of 192 splits over dp 8, 16, 24, 32, 48, 64, 96
    (micro-batch 2) but not 40; refused before any rank starts, in one line naming the counts that fit."""
    out = _launch({"HOSTNAME": "pretrain-0", "NNODES": "5", "LOCAL_NVME": str(tmp_path)})
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "5 node(s) x 8 rank(s) = world size 40 does not fit" in lines[0], lines[0]
    assert "192 is not divisible by micro_batch_size*dp=2*40" in lines[0], lines[0]
    fits = "fix: launch with a node count that fits: 1 (8 ranks), 2 (16 ranks), 3 (24 ranks), 4 (32 ranks), 6"
    assert fits in lines[0], lines[0]


def test_a_missing_tokenizer_file_is_named_as_itself_not_as_a_node_count(tmp_path: Path) -> None:
    """The node-count check judges only the topology rules: a config whose tokenizer file is missing
    (the 8B config on a login node without it) is refused naming that file, not "does not fit"."""
    missing = tmp_path / "nowhere" / "tokenizer.json"
    out = _launch(
        {"HOSTNAME": "pretrain-0", "NNODES": "4", "LOCAL_NVME": str(tmp_path)},
        *("--set", "data.tokenizer=huggingface", "--set", f"data.tokenizer_path={missing}"),
    )
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert str(missing) in lines[0] and "does not fit" not in lines[0], lines[0]


def test_scaled_attempts_are_recorded() -> None:
    earlier = [{"hosts": ["a", "b", "c"], "world_size": 3}, {"world_size": 3}]  # the last died unrecorded
    assert scaled_from(earlier, ["a", "b"], 2) == {
        "from_nodes": 3,
        "to_nodes": 2,
        "from_world_size": 3,
        "to_world_size": 2,
    }
    assert scaled_from(earlier, ["a", "b", "c"], 3) is None
    assert scaled_from([], ["a"], 1) is None


def test_nodelists() -> None:
    assert first_slurm_host("gpu[003-005,007],cpu01") == "gpu003"
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a-b[10-11]") == "a-b10"


def test_nodelist_expansion_keeps_padding() -> None:
    assert expand_slurm_nodelist("gpu[003-005,007],cpu01") == ["gpu003", "gpu004", "gpu005", "gpu007", "cpu01"]
    assert expand_slurm_nodelist("n[8-11]") == ["n8", "n9", "n10", "n11"]
    with pytest.raises(LaunchError, match="bad range"):
        expand_slurm_nodelist("gpu[a-b]")


def _scontrol_hostnames(nodelist: str, tmp_path: Path) -> list[str]:
    """Slurm's own expansion (``scontrol show hostnames`` reads only a config, no controller)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=d Nodes=localhost\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "Invalid" not in out.stderr, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize(
    "nodelist", ["rack[1-2]-node[01-02]", "gpu-[001-004,010]", "gpu[003-005,007],cpu01", "x[8-11],login"]
)
def test_multi_bracket_and_suffixed_nodelists_expand_as_slurm_does(nodelist: str, tmp_path: Path) -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (scripts/install-system-deps.sh installs Slurm)")
    assert expand_slurm_nodelist(nodelist) == _scontrol_hostnames(nodelist, tmp_path)


def test_a_suffix_after_the_brackets_and_unreadable_lists() -> None:
    # Slurm 22.05's scontrol calls "a[1-3]b" an invalid hostlist; newer ones and sites write it.
    assert expand_slurm_nodelist("a[1-3]b") == ["a1b", "a2b", "a3b"]
    assert expand_slurm_nodelist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    assert first_slurm_host("rack[1-2]-node[01-02]") == "rack1-node01"
    for bad in ("a[1-2", "a]1", "a,,b", "a[[1]]", "n[3-1]", ""):
        with pytest.raises(LaunchError, match="fix: run under sbatch/srun, or export RDZV_HOST"):
            expand_slurm_nodelist(bad)


def test_slurm_rdzv_host_from_the_sbatch_wins(tmp_path: Path) -> None:
    out = _launch({**_slurm_env(tmp_path), "RDZV_HOST": "10.0.0.7"})
    assert out.returncode == 0, out.stderr
    assert "--rdzv-endpoint=10.0.0.7:29500" in shlex.split(out.stdout.splitlines()[-1])
    text = (Path(__file__).resolve().parents[1] / "slurm" / "pretrain.sbatch").read_text()
    assert 'RDZV_HOST=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}' in text


def _slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURMD_NODENAME": "gpu02",
        "LOCAL_NVME": str(tmp_path),
        **extra,
    }


def test_failure_domain_from_a_topology_file(tmp_path: Path) -> None:
    topo = tmp_path / "topology.txt"
    topo.write_text("# node  leaf switch\ngpu01 leaf-a\ngpu02 leaf-b  # rack 2\n")
    out = _launch(_slurm_env(tmp_path, TOPOLOGY_FILE=str(topo)))
    assert out.returncode == 0, out.stderr
    assert "node gpu02, domain leaf-b" in out.stdout


@pytest.mark.parametrize(
    ("topology", "needle"),
    [
        ("gpu01 leaf-a\ngpu02 leaf-a\n", "puts all 2 nodes of this job in domain 'leaf-a'"),
        ("gpu01 leaf-a\n", "node gpu02 has no failure domain"),
        ("gpu01 leaf-a extra\ngpu02 leaf-b\n", "expected 'node domain'"),
    ],
)
def test_bad_topology_files_fail_at_start(tmp_path: Path, topology: str, needle: str) -> None:
    topo = tmp_path / "topology.txt"
    topo.write_text(topology)
    out = _launch(_slurm_env(tmp_path, TOPOLOGY_FILE=str(topo)))
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert needle in lines[0] and "fix:" in lines[0] and str(topo) in lines[0]


def test_workers_get_the_emergency_save_window(tmp_path: Path) -> None:
    env = {"HOSTNAME": "pretrain-0", "NNODES": "1", "LOCAL_NVME": str(tmp_path)}
    out = _launch(env, "--set", "fault_tolerance.emergency_save_timeout=50")
    assert "--workers-stop-timeout=60" in shlex.split(out.stdout.splitlines()[-1])
    bad = _launch(env, "--set", "train.stepz=3")
    assert bad.returncode == 2 and "unknown key 'train.stepz'" in bad.stderr
