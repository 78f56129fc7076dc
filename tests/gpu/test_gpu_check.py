"""The prepared single-GPU check (``scripts/gpu-check.sh``): the GPU path of the same code the CPU
suite tests, on the newest megatron-core and NVRx the GPU machine gets as carried wheels.

Each heavy check runs in its own process with a time limit (a crash or hang of one is recorded
and the others still run); every figure goes to the JSON report (``tests/gpu/conftest.py``).
Without CUDA every test skips, unless ``GPU_CHECK_MODE=cpu`` (the dry run in ``make test``).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nvidia_resiliency_ext import inprocess

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.commands.launch import LaunchPlan, check_flags, ft_launcher_argv
from pretrain.platform.compat import async_save_kwargs, megatron_core_version, write_results_queue_getter
from pretrain.platform.versions import framework_versions
from tests.gpu.conftest import versions

REPO = Path(__file__).resolve().parents[2]
# Seconds per check (each in its own process): on CUDA 190 + 60 + 90 + 100 = 440 s at most, inside
# the 450 s scripts/gpu-check.sh gives pytest (with the install, the run stays under 8 minutes).
# Caps, not measurements: no GPU has run the resilience check yet.
LIMITS = {
    "cuda": {"train": 190, "reshard": 60, "bench": 90, "resilience": 100},
    "cpu": {"train": 420, "reshard": 120, "bench": 60, "resilience": 300},
}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return {**env, **extra}


def _run_json(cmd: list[str], out: Path, limit: int, log: Path, **env: str) -> dict[str, Any]:
    """Run one check in its own process; its JSON result (what it had written, marked
    ``timed_out``, if it ran past ``limit``), or a failure naming the log's last lines."""
    out.unlink(missing_ok=True)
    timed_out = False
    returncode: int | None = None
    with log.open("w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=_env(**env), stdout=fh, stderr=subprocess.STDOUT, timeout=limit)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            timed_out = True
    if not out.is_file():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-3:]
        ended = f"ran past {limit} s" if timed_out else f"exited {returncode}"
        pytest.fail(f"{' '.join(cmd[:3])} {ended} without a result: {' | '.join(tail)}")
    return {**json.loads(out.read_text()), "timed_out": timed_out}


@pytest.fixture(scope="session")
def trained(mode: str, workdir: Path) -> dict[str, Any]:
    """The training run (baseline, in-process kill, restart) of :mod:`tests.gpu.train_driver`."""
    out = workdir / "train.json"
    cmd = [sys.executable, "-m", "tests.gpu.train_driver", "--mode", mode, "--workdir", str(workdir / "train")]
    return _run_json([*cmd, "--out", str(out)], out, LIMITS[mode]["train"], workdir / "train.log")


def test_versions_that_ran(mode: str, record: dict[str, Any]) -> None:
    """torch, CUDA, megatron-core, NVRx, TE, and which side of pretrain/platform/compat.py is in use."""
    record.update(versions())
    record["async_save_kwargs"] = async_save_kwargs()
    record["write_results_queue"] = write_results_queue_getter().__name__
    assert megatron_core_version() != "unknown"
    assert framework_versions()["nvidia-resiliency-ext"] != "not-installed"
    # In-process restart (deprecated upstream since NVRx 0.6): the Wrapper still takes every
    # argument pretrain/resilience/inprocess.py passes.
    passed = set(re.findall(r"^\s{8}(\w+)=", (REPO / "pretrain" / "resilience" / "inprocess.py").read_text(), re.M))
    accepted = set(inspect.signature(inprocess.Wrapper.__init__).parameters)
    record["inprocess_wrapper_kwargs_missing"] = sorted(passed - accepted)
    assert passed and passed <= accepted, sorted(passed - accepted)


def test_ft_launcher_accepts_every_flag_we_pass(mode: str, record: dict[str, Any], tmp_path: Path) -> None:
    """`pretrain launch` and the demo's command line against the installed ft_launcher's --help."""
    launcher = shutil.which("ft_launcher") or str(Path(sys.executable).with_name("ft_launcher"))
    plan = LaunchPlan("slurm", 0, 2, "node-a:29500", "node-a", "rack-1", str(tmp_path), "run-1", 0)
    cluster = ft_launcher_argv(plan, "c.yaml", 8, 3, "ft.yaml", launcher, [], 40)
    local = ft_launcher_command("c.yaml", 2, "ft.yaml", rdzv_port=29500, nnodes=2)
    local[0] = launcher
    record["launcher"] = launcher
    record["nvidia-resiliency-ext"] = framework_versions()["nvidia-resiliency-ext"]
    record["flags"] = sorted({a.split("=", 1)[0] for a in cluster[1:] + local[1:] if a.startswith("--")})
    flags = [a for a in cluster[1 : cluster.index("-m")] + local[1 : local.index("-m")]]
    check_flags(launcher, [launcher, *flags])  # one --help: it imports all of NVRx's launcher


def test_train_kill_restart_resumes_exactly(mode: str, trained: dict[str, Any], record: dict[str, Any]) -> None:
    """bf16 + DistributedOptimizer on GPU; an in-process kill at step 17 and a restart from the
    background tier-1 step 15 (the dp-reshardable optimizer state): the same losses as the
    uninterrupted run, bit for bit under deterministic algorithms."""
    local = [
        s["blocked_seconds"]
        for s in trained.get("saves", [])
        if s["tier"] == "local" and s["blocked_seconds"] is not None
    ]
    keys = ("spec", "distributed_optimizer", "precision", "device", "errors", "phase_errors", "timed_out")
    record.update({k: trained.get(k) for k in keys})
    kept = ("comparison", "first_step_after_restart", "nondeterministic_warnings", "deterministic_env")
    record.update({k: trained.get(k) for k in kept})
    record["restored"] = [{k: e.get(k) for k in ("tier", "step", "seconds")} for e in trained.get("restore_events", [])]
    record["tier1_blocked_seconds"] = {"max": max(local, default=None), "n": len(local)}
    record["reshardable_saves"] = [s for s in trained.get("saves", []) if s["tier"] == "reshardable"]
    assert trained["errors"].get("baseline") is None, trained["errors"]
    assert "injected" in (trained["errors"].get("fault") or ""), trained["errors"]
    assert trained["errors"].get("restart") is None, trained["errors"]
    if mode == "cuda":
        assert trained["precision"] == "bf16" and trained["distributed_optimizer"], trained
    assert trained["restore_events"] and trained["restore_events"][-1]["tier"] == "local", trained["restore_events"]
    assert trained["first_step_after_restart"] == trained["restore_events"][-1]["step"] + 1
    assert local, "no background tier-1 save was reported"
    assert trained["comparison"]["ok"], trained["comparison"]


def test_each_parameter_keeps_its_own_adam_step_after_a_restore(
    mode: str, trained: dict[str, Any], record: dict[str, Any]
) -> None:
    """The newest tier-1 file of each restarted run holds, for every parameter (and the parameter
    groups), the Adam step of that step: a ``step`` tensor shared by all parameters after a load
    would have counted every parameter at each step since the restore."""
    runs = {"tier1_restore": trained.get("tier1_after_restart")}
    runs["reshardable_restore"] = trained.get("reshardable_restore", {}).get("tier1_after_restart")
    record.update(runs)
    for name, found in runs.items():
        assert found and found["file"], f"{name}: no tier-1 file after the restart ({trained.get('phase_errors')})"
        assert found["count"] > 0 and found["adam_steps"] == [float(found["step"])], (name, found)


def test_reshardable_restore_of_the_optimizer_resumes_exactly(
    mode: str, trained: dict[str, Any], record: dict[str, Any]
) -> None:
    """A kill at step 12 with the tier-1 steps lost: the restart restores the fully reshardable
    step 10 (on GPU the DistributedOptimizer loaded through ``sharded_state_dict(is_loading=True)``)
    and its losses equal the uninterrupted run's."""
    run = trained.get("reshardable_restore")
    assert run, f"the reshardable-restore run did not run: {trained.get('phase_errors')}"
    record.update({k: run.get(k) for k in ("fault_error", "restart_error", "restore_events", "comparison")})
    assert "injected" in (run["fault_error"] or ""), run["fault_error"]
    assert run["restart_error"] is None, run["restart_error"]
    assert run["restore_events"] and run["restore_events"][-1]["tier"] == "reshardable", run["restore_events"]
    assert run["first_step_after_restart"] == run["restore_events"][-1]["step"] + 1, run
    assert run["comparison"]["ok"], run["comparison"]


def _newest_step(run: Path) -> Path:
    steps = sorted(p for p in (run / "steps").glob("step-*") if (p / "COMMITTED").is_file())
    assert steps, f"no committed reshardable step under {run}"
    return steps[-1]


def test_reshardable_checkpoint_loads_on_cpu_at_tp2(
    mode: str, trained: dict[str, Any], workdir: Path, record: dict[str, Any]
) -> None:
    """The baseline run's newest reshardable step (1 rank) loaded by 2 gloo ranks on CPU at TP=2:
    every shard equals the same slice of the tensor read by torch alone."""
    step = _newest_step(Path(trained["reshardable_dir"]))
    out = workdir / "reshard.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*torchrun, "-m", "tests.gpu.reshard_rank", "--mode", mode, "--checkpoint", str(step), "--out", str(out)]
    # The load is the CPU path even on a GPU host.
    result = _run_json(cmd, out, LIMITS[mode]["reshard"], workdir / "reshard.log", CUDA_VISIBLE_DEVICES="")
    record.update(result)
    assert all(r["compared"] > 0 for r in result["per_rank"]), result
    assert result["all_equal"], result
    assert not result["unread_keys"], f"checkpoint tensors not matched to the CPU model: {result['unread_keys'][:5]}"


def test_background_save_blocks_less_than_a_sync_save(mode: str, workdir: Path, record: dict[str, Any]) -> None:
    """>= 10 GB of GPU state: blocked time per background save / sync save, snapshot bandwidth /
    raw pinned copy_, steps/s with / without a save (one run, see tests/gpu/snapshot_bench.py)."""
    out = workdir / "bench.json"
    limit = LIMITS[mode]["bench"]
    cmd = [sys.executable, "-m", "tests.gpu.snapshot_bench", "--mode", mode, "--workdir", str(workdir / "bench")]
    cmd += ["--budget-s", str(limit * 0.8), "--out", str(out)]
    result = _run_json(cmd, out, limit, workdir / "bench.log")
    record.update(result)
    if mode == "cuda" and result["sizing"]["limited_by"] == "model":
        assert result["state_gb"] >= 10, result["state_gb"]
    assert result["blocked_ratio"] < 1, result


def test_snapshot_copy_runs_on_the_tensors_device(mode: str, workdir: Path, record: dict[str, Any]) -> None:
    """The writer thread's copy: bound to the device of the saved tensors, its stream there. On
    one GPU everything is cuda:0; a rank on cuda:1 staying there needs a second GPU."""
    bench = workdir / "bench.json"
    if not bench.is_file():
        pytest.fail("no snapshot bench result (test_background_save_blocks_less_than_a_sync_save)")
    binding = json.loads(bench.read_text())["copy_binding"]
    record["copy_binding"] = binding
    if mode == "cpu":
        assert binding is None  # no CUDA tensors: no stream, no binding
        return
    assert binding["tensors"] == binding["thread"] == binding["stream"] == "cuda:0", binding


def test_a_job_restarts_in_process_and_under_its_launcher_from_tier0_with_ranks_forked_by_standby(
    mode: str, workdir: Path, record: dict[str, Any]
) -> None:
    """ft_launcher + rank monitor + standby + NVRx's Wrapper + tier 0 every step (every GPU: DP > 1
    with two or more, see tests/gpu/resilience_driver.py): an exception restarts in the same
    processes from tier 0's step before it; a SIGKILL from outside restarts the rank (a fork again)
    from tier 0, losing at most one step."""
    out = workdir / "resilience.json"
    cmd = [
        sys.executable,
        "-m",
        "tests.gpu.resilience_driver",
        "--mode",
        mode,
        "--workdir",
        str(workdir / "resilience"),
    ]
    result = _run_json([*cmd, "--out", str(out)], out, LIMITS[mode]["resilience"], workdir / "resilience.log")
    record.update({k: v for k, v in result.items() if k != "log_tail"})
    assert result["returncode"] == 0 and result["last_step"] == result["steps"], result["log_tail"]
    assert result["standby_served"], result["standby_lines"]
    inprocess, relaunch = result["restores"][0], result["restores"][-1]
    assert len(result["restores"]) == 2, result["restores"]
    assert (inprocess["tier"], inprocess["step"]) == ("memory", result["raise_step"] - 1), inprocess
    assert result["starts"][0]["pids"] == result["starts"][1]["pids"], "the in-process restart kept its processes"
    assert result["killer_error"] is None and result["killed_after_step"] is not None, result["killer_error"]
    lost = result["killed_after_step"] - relaunch["step"]
    assert relaunch["tier"] == "memory" and lost in (0, 1), (relaunch, result["killed_after_step"])
    assert result["starts"][-1]["pids"] != result["starts"][0]["pids"], "the SIGKILL restarted the rank"
