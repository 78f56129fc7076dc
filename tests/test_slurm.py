"""slurm/pretrain.sbatch on a real one-node Slurm cluster (``slurm_cluster``, KillWait 5 s).

* ``scontrol requeue`` mid-run: the requeued job resumes from the newest verified step and finishes.
* The USR1 warning: the batch shell sends SIGTERM to the ranks, waits while they publish their
  emergency step (held longer than KillWait), requeues, and the job resumes from that step.
* A failed launcher: the job is requeued without the node it failed on.
* A node the run excluded (a persistent straggler): `pretrain launch` refuses it and the job is
  requeued with it in ``--exclude`` (ExcNodeList). The cluster's second node (``spare``) never
  starts, so the requeued job pends; when the exclusion would leave no node, the requeue is refused
  in one line and the job ends.
* A stopped run (``attempts/STOP.json``): `pretrain launch` exits with the stop code on every node
  and the job ends with it, not requeued.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

from pretrain.commands.launch import mark_node_state
from pretrain.commands.plan import plan_memory_tier
from pretrain.commands.plan_model import model_size
from pretrain.config import MemoryTierConfig, load_config
from pretrain.errors import EXCLUDED_EXIT_CODE, STOP_EXIT_CODE
from tests.helpers import FT_CPU, REPO, TINY, free_port, job_env, overrides_for, read_jsonl

SBATCH = REPO / "slurm" / "pretrain.sbatch"
KILL_WAIT_S = 5  # scripts/slurm/slurm.conf.in
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _show_job(job: str, env: dict[str, str]) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout


def _job_state(job: str, env: dict[str, str]) -> tuple[str, int]:
    out = _show_job(job, env)
    state = re.search(r"JobState=(\S+)", out)
    restarts = re.search(r"Restarts=(\d+)", out)
    return (state.group(1) if state else "UNKNOWN"), int(restarts.group(1)) if restarts else 0


def _max_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return max((rec["step"] for rec in read_jsonl(metrics)), default=0)


def _tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.exists() else ""


class SlurmJob:
    """One sbatch of slurm/pretrain.sbatch on the test cluster with the tiny CPU model."""

    def __init__(self, tmp: Path, corpus: Path, cluster: dict[str, str], overrides: dict[str, Any], **env: str) -> None:
        cfg = load_config(TINY, overrides_for(tmp, corpus, **{"checkpoint.reshardable.interval": 1000, **overrides}))
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(cfg.to_dict()))
        (tmp / "nvme").mkdir()
        self.env = {
            **job_env(tmp),
            "SLURM_CONF": cluster["SLURM_CONF"],
            "CONFIG": str(config),
            "LOCAL_NVME": str(tmp / "nvme"),
            "NPROC_PER_NODE": "2",
            "MAX_RESTARTS": "1",
            "FT_CONFIG": str(FT_CPU),
            "PRETRAIN": str(REPO / ".venv" / "bin" / "pretrain"),
            # Not the default 29500: another job on this machine may hold it, and a launcher that
            # cannot bind its rendezvous store fails, which requeues the job without the node.
            "RDZV_PORT": str(free_port()),
            "NODE_STATE_DIR": str(tmp / "node-state"),  # the epilog's markers, not the machine's /dev/shm
            **env,
        }
        self.tmp = tmp
        self.run_dir = tmp / "runs" / "t"
        self.id = ""

    @property
    def log(self) -> Path:
        return self.tmp / f"slurm-{self.id}.out"

    def submit(self, *sbatch_args: str) -> None:
        out = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", f"--output={self.tmp}/slurm-%j.out", *sbatch_args, str(SBATCH)],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.tmp,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        self.id = out.stdout.strip().split(";")[0]

    def state(self) -> tuple[str, int]:
        return _job_state(self.id, self.env)

    def wait_for_step(self, step: int, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while _max_step(self.run_dir / "metrics.jsonl") < step:
            assert time.monotonic() < deadline, f"no progress: {self.state()}\n{_tail(self.log)}"
            time.sleep(0.2)

    def wait_until(self, states: tuple[str, ...], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.state()[0]) not in states:
            assert time.monotonic() < deadline, f"job {self.id} still {state}\n{_tail(self.log)}"
            time.sleep(0.3)
        return state

    def release_requeued(self) -> None:
        """Slurm holds a requeued job for 120 s before it is eligible again (users see that too);
        the test makes it eligible at once when it is back in the queue."""
        self.wait_until(("PENDING",), 300)
        # Not before slurmd has cleaned up the previous run: a start while the node is still
        # COMPLETING is killed at once ("Job credential revoked": the old run's credential).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "COMPLETING" in self._node_state():
            time.sleep(0.2)
        time.sleep(2.0)  # slurmd revokes the old credential for a moment after the node is idle
        subprocess.run(["scontrol", "update", f"JobId={self.id}", "StartTime=now"], env=self.env, check=True)

    def _node_state(self) -> str:
        out = subprocess.run(["scontrol", "show", "node", "localhost"], capture_output=True, text=True, env=self.env)
        return out.stdout.upper()

    def attempts(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted((self.run_dir / "attempts").glob("attempt-*.json"))]


@pytest.mark.slow
def test_sbatch_requeue_resumes_from_the_newest_verified_step(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    # Enough steps that the requeue lands while the first run trains (it is sent at step 25, and
    # ends the run within a second or two), few enough that the resumed run is not most of the test.
    steps = 100
    job = SlurmJob(tmp_path, corpus, slurm_cluster, {"train.steps": steps, "fault_tolerance.emergency_save_timeout": 8})
    job.submit()
    job.wait_for_step(25)
    requeue = subprocess.run(["scontrol", "requeue", job.id], capture_output=True, text=True, env=job.env)
    assert requeue.returncode == 0, requeue.stderr
    job.release_requeued()
    state = job.wait_until(ENDED, 600)  # slow when the machine is shared
    text = job.log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert job.state()[1] == 1, "Slurm counted other than one requeue"
    assert "restart count 0" in text and "restart count 1" in text

    records = job.attempts()
    assert [r.get("slurm_restart_count") for r in records] == [0, 1], records
    first, second = records
    assert first["status"] in ("preempted", "failed") and first["slurm_job_id"] == second["slurm_job_id"] == job.id
    assert second["status"] == "succeeded" and second["last_step"] == steps
    restored = second["restored"]
    assert restored is not None and restored["step"] > 0, "the requeued job must not start from step 0"
    # The newest verified step: the emergency step if it was published, else the last interval step.
    expected = first["last_step"] if first.get("emergency_published") else first["last_step"] // 10 * 10
    assert restored["step"] == expected, (first, second)
    assert second["lost_steps"] == first["last_step"] - restored["step"]
    assert _max_step(job.run_dir / "metrics.jsonl") == steps


@pytest.mark.slow
def test_usr1_warning_gives_the_emergency_save_more_than_killwait_then_requeues_and_resumes(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    steps, hold = 70, 3 * KILL_WAIT_S  # the warning is sent at step 20: the first run ends before 50
    job = SlurmJob(
        tmp_path,
        corpus,
        slurm_cluster,
        {
            "train.steps": steps,
            "checkpoint.local.interval": 50,  # the emergency step is newer than any interval step
            "fault_tolerance.emergency_save_timeout": hold + 25,
            # Every rank stays `hold` seconds in the emergency-save phase: a save slower than KillWait.
            "fault_tolerance.inject.hold_at": "0:emergency_save",
            "fault_tolerance.inject.hold_seconds": hold,
        },
        WARNING_S="90",
    )
    job.submit()
    job.wait_for_step(20)
    warned_at = time.time()
    # What Slurm does WARNING_S before the time limit (--signal=B:USR1@N): USR1 to the batch shell only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], env=job.env, check=True)
    job.release_requeued()
    state = job.wait_until(ENDED, 600)  # slow when the machine is shared
    text = job.log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "USR1: job ends in 90s" in text and "ranks exited after the warning; requeueing" in text, text[-4000:]
    assert job.state()[1] == 1, "Slurm counted other than one requeue"

    first, second = job.attempts()
    assert first["status"] == "preempted" and first["emergency_published"] is True, first
    assert first["last_step"] % 50 != 0, "the emergency step must not be an interval step"
    events = [json.loads(x) for x in (job.run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    preempted = next(e for e in events if e["event"] == "preempted")
    assert preempted["published"] is True, preempted
    # The save was committed after Slurm's KillWait had passed: the warning's time was used.
    assert preempted["time"] - warned_at > hold > KILL_WAIT_S, (preempted, warned_at)
    assert second["restored"]["step"] == first["last_step"], (first, second)
    assert second["lost_steps"] == 0 and second["status"] == "succeeded" and second["last_step"] == steps


@pytest.mark.slow
def test_sigterm_to_the_batch_shell_saves_like_the_warning_and_leaves_the_requeue_to_slurm(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    """What a preemption (or a scancel) does to the batch shell: SIGTERM. The shell sends SIGTERM
    to the ranks, waits for their emergency step, and does not requeue the job itself (a preempted
    job is requeued by Slurm; this cluster has no preemption configured, so the job ends)."""
    job = SlurmJob(
        tmp_path,
        corpus,
        slurm_cluster,
        {"train.steps": 500, "checkpoint.local.interval": 50, "fault_tolerance.emergency_save_timeout": 30},
    )
    job.submit()
    try:
        job.wait_for_step(12)
        subprocess.run(["scancel", "--signal=TERM", "--batch", job.id], env=job.env, check=True)
        state = job.wait_until(ENDED, 300)
        text = job.log.read_text()
        assert "TERM: preempted or cancelled" in text and "ranks exited after TERM" in text, text[-4000:]
        assert "requeued" not in text and job.state()[1] == 0, "Slurm's requeue, never the script's"
        assert state in ("FAILED", "CANCELLED"), state
        (first,) = job.attempts()
        assert first["status"] == "preempted" and first["emergency_published"] is True, first
        assert first["last_step"] % 50 != 0, "the emergency step, not an interval step"
    finally:
        subprocess.run(["scancel", job.id], env=job.env, timeout=30)


@pytest.mark.slow
def test_a_failed_launcher_requeues_the_job_without_its_node(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    job = SlurmJob(
        tmp_path,
        corpus,
        slurm_cluster,
        {"train.steps": 500, "fault_tolerance.inject.kill_rank": 1, "fault_tolerance.inject.kill_at_step": 5},
        MAX_RESTARTS="0",  # ft_launcher gives up at the first failure
    )
    job.submit()
    try:
        deadline = time.monotonic() + 480
        while "requeued without node localhost" not in _tail(job.log):
            assert time.monotonic() < deadline, f"{job.state()}\n{_tail(job.log)}"
            time.sleep(0.3)
        job.wait_until(("PENDING",), 60)
        show = _show_job(job.id, job.env)
        assert "ExcNodeList=localhost" in show and "Restarts=1" in show, show
        text = job.log.read_text()
        assert "srun: error: localhost: task 0: Exited with exit code 1" in text
        # Excluded for the record's evidence (its rank 1 was killed), not for exiting first.
        host = socket.gethostname()  # the records name hosts; Slurm's node here is "localhost"
        assert f"the run's records blame node localhost (host {host}): attempt 1: rank 1 on {host}" in text, text[
            -3000:
        ]
    finally:
        subprocess.run(["scancel", job.id], env=job.env, timeout=30)


def _job_of_a_run_that_excluded_localhost(tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]) -> SlurmJob:
    """A job whose run already wrote localhost (the cluster's node) into its excluded-nodes file."""
    job = SlurmJob(tmp_path, corpus, slurm_cluster, {"train.steps": 50})
    line = {"node": "localhost", "reason": "slow in 3 straggler reports in a row up to step 30"}
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "excluded-nodes.jsonl").write_text(json.dumps(line) + "\n")
    return job


@pytest.mark.slow
def test_a_node_the_run_excluded_is_refused_and_the_job_requeued_without_it(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    job = _job_of_a_run_that_excluded_localhost(tmp_path, corpus, slurm_cluster)
    job.submit()
    try:
        deadline = time.monotonic() + 300
        while "requeued without node localhost" not in _tail(job.log):
            assert time.monotonic() < deadline, f"{job.state()}\n{_tail(job.log)}"
            time.sleep(0.3)
        job.wait_until(("PENDING",), 60)
        show = _show_job(job.id, job.env)
        assert "ExcNodeList=localhost" in show and "Restarts=1" in show, show
        text = job.log.read_text()
        assert "launch refused: node localhost is excluded" in text and "excluded node(s) localhost" in text, text
        assert not (job.run_dir / "metrics.jsonl").exists(), "no rank may start on an excluded node"
    finally:
        subprocess.run(["scancel", job.id], env=job.env, timeout=30)


@pytest.mark.slow
def test_a_requeue_that_would_exclude_every_node_is_refused_in_one_line_and_the_job_ends(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    job = _job_of_a_run_that_excluded_localhost(tmp_path, corpus, slurm_cluster)
    job.submit("--exclude=spare")  # excluding localhost too leaves the partition no node
    state = job.wait_until(ENDED, 300)
    show = _show_job(job.id, job.env)
    assert state == "FAILED" and f"ExitCode={EXCLUDED_EXIT_CODE}:0" in show and "Restarts=0" in show, show
    refused = [x for x in job.log.read_text().splitlines() if "not requeued" in x]
    assert len(refused) == 1, job.log.read_text()
    assert re.search(r"without node\(s\) (spare,localhost|localhost,spare) partition debug has 0 node\(s\)", refused[0])
    assert "for this 1-node job; fix: repair node(s) localhost" in refused[0], refused[0]
    assert "requeued without" not in job.log.read_text()


@pytest.mark.slow
def test_a_stopped_run_ends_the_job_with_the_stop_code_instead_of_requeueing(
    tmp_path: Path, corpus: Path, slurm_cluster: dict[str, str]
) -> None:
    job = SlurmJob(tmp_path, corpus, slurm_cluster, {"train.steps": 50})
    stop = job.run_dir / "attempts" / "STOP.json"
    stop.parent.mkdir(parents=True)
    stop.write_text(json.dumps({"reason": "the same user error twice at step 3"}))
    job.submit()
    state = job.wait_until(ENDED, 300)
    show = _show_job(job.id, job.env)
    assert state == "FAILED" and f"ExitCode={STOP_EXIT_CODE}:0" in show and "Restarts=0" in show, show
    text = job.log.read_text()
    assert "launch refused" in text and "not requeueing" in text, text


def test_the_sbatch_stop_code_is_the_rank_programs() -> None:
    assert re.search(rf"^STOP_EXIT_CODE={STOP_EXIT_CODE} ", SBATCH.read_text(), re.M)


def test_the_h100_ft_config_is_nvrx_valid_and_times_every_section_the_rank_program_opens() -> None:
    ft = FaultToleranceConfig.from_yaml_file(str(REPO / "configs" / "ft-h100.yaml"), ignore_not_recognized=False)
    sections = set(re.findall(r'monitor\.start\("(\w+)"\)', _rank_program_sources()))
    assert sections == set(ft.rank_section_timeouts) == {"setup", "step", "checkpointing"}
    assert ft.initial_rank_heartbeat_timeout >= 1200 and ft.rank_section_timeouts["setup"] >= 1200
    big = yaml.safe_load((REPO / "configs" / "gpt-8b-h100.yaml").read_text())
    emergency = big["fault_tolerance"]["emergency_save_timeout"]
    warning = int(re.search(r"--signal=B:USR1@(\d+)", SBATCH.read_text()).group(1))
    # The save and ft_launcher's stop (+10 s in pretrain launch) end before the trap's requeue (-10 s).
    assert emergency + 10 <= warning - 10 and emergency < ft.rank_section_timeouts["checkpointing"]


def test_the_sbatch_sizes_tier0_in_dev_shm_as_pretrain_plan_does() -> None:
    """Tier 0's default dir is the node's /dev/shm, and the RAM the sbatch quotes for the 8B config
    is what `pretrain plan` prints for it on 4 nodes x 8 GPUs."""
    text = SBATCH.read_text()
    assert MemoryTierConfig().dir.startswith("/dev/shm/") and MemoryTierConfig().dir in text
    cfg = load_config(REPO / "configs" / "gpt-8b-h100.yaml")
    size = model_size(cfg, 4 * 8)
    plan = plan_memory_tier(size.state_bytes_per_rank, 8, cfg.checkpoint.memory.slots, 1, None, None)
    quoted = re.search(
        r"prints as tier 0's \"RAM per node\".*?: ([\d.]+) GB for\s+#\s+configs/gpt-8b-h100.yaml", text, re.S
    )
    assert quoted and float(quoted.group(1)) == round(plan.ram_per_node_bytes / 1e9, 2)


def _rank_program_sources() -> str:
    return "".join(p.read_text() for p in (REPO / "pretrain").rglob("*.py"))


def _held_job(env: dict[str, str], tmp: Path) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", "--hold", f"--output={tmp}/held-%j.out", "--wrap", "true"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return out.stdout.strip().split(";")[0]


@pytest.mark.slow
def test_the_epilog_removes_node_local_data_of_an_ended_job_never_of_a_pending_one(
    tmp_path: Path, slurm_cluster: dict[str, str]
) -> None:
    """slurm/epilog.sh against the real slurmctld: a job that is PENDING (as a requeued job is)
    keeps its tier-0/tier-1 directories; once cancelled they go, unless another live job of the
    same run has a marker on the node."""
    env = {**job_env(tmp_path), "SLURM_CONF": slurm_cluster["SLURM_CONF"], "NODE_STATE_DIR": str(tmp_path / "jobs")}
    (tmp_path / "jobs").mkdir()
    first, second = _held_job(env, tmp_path), _held_job(env, tmp_path)
    dirs = {}
    for job, run in ((first, "run-a"), (second, "run-a")):
        dirs[job] = [tmp_path / "nvme" / run, tmp_path / "shm" / run]
        for d in dirs[job]:
            (d / "rank-00000").mkdir(parents=True, exist_ok=True)
        marker = {"job": job, "run_id": run, "dirs": [str(d) for d in dirs[job]]}
        (tmp_path / "jobs" / f"{job}.json").write_text(json.dumps(marker))
    epilog = [str(REPO / "slurm" / "epilog.sh")]
    try:
        out = subprocess.run(epilog, capture_output=True, text=True, env={**env, "SLURM_JOB_ID": first}, check=True)
        assert f"job {first} is PENDING" in out.stdout and all(d.exists() for d in dirs[first]), out.stdout
        subprocess.run(["scancel", first], env=env, check=True)
        _wait_state(first, env, "CANCELLED")
        out = subprocess.run(epilog, capture_output=True, text=True, env={**env, "SLURM_JOB_ID": first}, check=True)
        assert f"job {second} of run run-a uses this node: kept" in out.stdout, out.stdout
        assert all(d.exists() for d in dirs[first])
        subprocess.run(["scancel", second], env=env, check=True)
        _wait_state(second, env, "CANCELLED")
        out = subprocess.run(epilog, capture_output=True, text=True, env={**env, "EPILOG_ALL": "1"}, check=True)
        assert not any(d.exists() for d in dirs[first]), out.stdout
        assert f"job {first} (CANCELLED): removed {tmp_path / 'nvme' / 'run-a'}" in out.stdout, out.stdout
        assert list((tmp_path / "jobs").iterdir()) == []
    finally:
        subprocess.run(["scancel", first, second], env=env, timeout=30)


def _wait_state(job: str, env: dict[str, str], state: str) -> None:
    deadline = time.monotonic() + 60
    while _job_state(job, env)[0] != state:
        assert time.monotonic() < deadline, _show_job(job, env)
        time.sleep(0.3)


def test_launch_leaves_the_epilog_a_marker_of_the_nodes_run_directories(tmp_path: Path) -> None:
    env = {"NODE_STATE_DIR": str(tmp_path / "jobs")}
    marker = mark_node_state("77", "run-a", ["/nvme/run-a", "/dev/shm/resilient-pretrain/run-a"], env)
    assert marker == tmp_path / "jobs" / "77.json"
    assert json.loads(marker.read_text()) == {
        "job": "77",
        "run_id": "run-a",
        "dirs": ["/nvme/run-a", "/dev/shm/resilient-pretrain/run-a"],
    }


def test_pyxis_lets_the_hosts_image_digest_win_and_mounts_no_home() -> None:
    """pyxis keeps an image ENV value over the exported host one unless --container-env names it
    (its --help); the Dockerfile sets ENV IMAGE_DIGEST=unknown. Home is not mounted: a user's
    ~/.local would shadow the image's packages."""
    text = SBATCH.read_text()
    (flags,) = re.findall(r"container=\(--container-image=.*?\)\n", text, re.S)
    assert "--container-env=IMAGE_DIGEST,RDZV_HOST" in flags and "--no-container-mount-home" in flags
    assert re.search(r"^#SBATCH --wait-all-nodes=1$", text, re.M)
    assert 'srun_errors=$(mktemp "${TMPDIR:-/tmp}/pretrain-srun-' in text, "never a predictable /tmp name"


def _freezer_allows_groups() -> bool:
    """What start.sh probes: can this root make a cgroup v1 freezer group?"""
    probe = Path(f"/sys/fs/cgroup/freezer/rp-test-probe-{os.getpid()}")
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return True


def test_job_steps_are_tracked_by_cgroup_where_the_machine_allows_it(slurm_cluster: dict[str, str]) -> None:
    """As production clusters run (proctrack/cgroup: a step's processes are found, signalled and
    killed through its freezer group, not through parent links a daemonised child escapes)."""
    config = subprocess.run(["scontrol", "show", "config"], env=slurm_cluster, capture_output=True, text=True)
    tracking = next(x.split("=", 1)[1].strip() for x in config.stdout.splitlines() if x.startswith("ProctrackType"))
    if not _freezer_allows_groups():
        assert tracking == "proctrack/linuxproc"
        pytest.skip("this machine has no cgroup v1 freezer this root can use: proctrack/linuxproc")
    assert tracking == "proctrack/cgroup"
    step = subprocess.run(
        ["srun", "-N1", "-n1", "cat", "/proc/self/cgroup"],
        env=slurm_cluster,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert step.returncode == 0, step.stderr
    assert any(":freezer:/slurm_localhost/" in x and "/step_" in x for x in step.stdout.splitlines()), step.stdout
