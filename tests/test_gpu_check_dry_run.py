"""The prepared single-GPU check cannot rot: ``scripts/gpu-check.sh --cpu`` runs the same entry
points (training with an in-process kill and restart, the reshard load at 2 gloo ranks, the
snapshot benchmark, the version and ft_launcher-flag checks, a job under ft_launcher with standby,
the in-process Wrapper and tier 0, restarted in-process and by the launcher) at CPU size in make test (the main
pytest run collects tests/gpu/ too, in its default GPU mode: without CUDA every test there skips);
the offline wheel installer picks wheels by interpreter, ABI and glibc and installs them into a target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from install_carried_wheels import fits, python_fits, unpack  # noqa: E402  (a script, not a package)

GPU_TESTS = {
    "test_versions_that_ran",
    "test_ft_launcher_accepts_every_flag_we_pass",
    "test_train_kill_restart_resumes_exactly",
    "test_reshardable_checkpoint_loads_on_cpu_at_tp2",
    "test_background_save_blocks_less_than_a_sync_save",
    "test_each_parameter_keeps_its_own_adam_step_after_a_restore",
    "test_reshardable_restore_of_the_optimizer_resumes_exactly",
    "test_snapshot_copy_runs_on_the_tensors_device",
    "test_a_job_restarts_in_process_and_under_its_launcher_from_tier0_with_ranks_forked_by_standby",
}


def _gpu_check(tmp: Path, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp / "report.json"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp)}
    cmd = [str(REPO / "scripts" / "gpu-check.sh"), *args, "--report", str(report), "--workdir", str(tmp / "work")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert report.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(report.read_text())


@pytest.mark.slow  # a job of a minute: make test runs it, make test-fast leaves it out
def test_cpu_dry_run_of_the_gpu_check(tmp_path: Path) -> None:
    proc, report = _gpu_check(tmp_path, "--cpu", timeout=960)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["mode"] == "cpu" and set(report["tests"]) == GPU_TESTS
    assert {t["outcome"] for t in report["tests"].values()} == {"passed"}, report["tests"]
    assert report["versions"]["megatron-core"] and report["versions"]["torch"]
    train = report["tests"]["test_train_kill_restart_resumes_exactly"]["figures"]
    assert train["comparison"]["identical"] and train["spec"] == "local", train
    assert train["restored"][-1]["tier"] == "local"
    reshard_restore = report["tests"]["test_reshardable_restore_of_the_optimizer_resumes_exactly"]["figures"]
    assert reshard_restore["restore_events"][-1]["tier"] == "reshardable" and reshard_restore["comparison"]["identical"]
    steps = report["tests"]["test_each_parameter_keeps_its_own_adam_step_after_a_restore"]["figures"]
    assert steps["tier1_restore"]["adam_steps"] == [8.0] and steps["reshardable_restore"]["adam_steps"] == [8.0]
    reshard = report["tests"]["test_reshardable_checkpoint_loads_on_cpu_at_tp2"]["figures"]
    assert reshard["all_equal"] and reshard["layout"]["tp"] == 2 and reshard["optimizer_keys"] > 0
    bench = report["tests"]["test_background_save_blocks_less_than_a_sync_save"]["figures"]
    assert 0 < bench["blocked_ratio"] < 1 and bench["snapshot"]["gb_per_s"] > 0
    assert bench["sizing"]["limited_by"] and bench["copy_binding"] is None
    job = report["tests"][
        "test_a_job_restarts_in_process_and_under_its_launcher_from_tier0_with_ranks_forked_by_standby"
    ]
    figures = job["figures"]
    assert figures["world_size"] == 2 and figures["standby_served"], figures
    assert [r["tier"] for r in figures["restores"]] == ["memory", "memory"], figures["restores"]


def test_wheels_are_picked_by_interpreter_and_glibc() -> None:
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    glibc = tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[-1].split("."))
    assert fits(Path("tqdm-4.70.1-py3-none-any.whl"))
    assert fits(Path(f"x-1.0-{here}-{here}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"))
    newer = f"{glibc[0]}_{glibc[1] + 1}"
    assert not fits(Path(f"nvidia_resiliency_ext-0.7.0-{here}-{here}-manylinux_{newer}_x86_64.whl"))
    assert not fits(Path("megatron_core-0.19.2-cp399-cp399-manylinux_2_28_x86_64.whl"))


def test_stable_abi_wheels_fit_every_cpython_from_their_minimum() -> None:
    assert python_fits("cp39", "abi3", here=(3, 12)) and python_fits("cp312", "abi3", here=(3, 12))
    assert not python_fits("cp313", "abi3", here=(3, 12))  # needs a newer CPython
    assert not python_fits("cp39", "cp39", here=(3, 12))  # an ordinary extension: its own version only
    assert not python_fits("cp29", "abi3", here=(3, 12)) and not python_fits("py2", "none", here=(3, 12))
    assert fits(Path("cryptography-44.0.0-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"))


def _tiny_wheel(wheels: Path, tags: str = "py3-none-any", name: str = "rp_probe") -> Path:
    path = wheels / f"{name}-1.0-{tags}.whl"
    dist = name.replace("_", "-")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "def main() -> int:\n    print('probe ok')\n    return 0\n")
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        zf.writestr(f"{name}-1.0.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tags}\n")
        zf.writestr(f"{name}-1.0.dist-info/entry_points.txt", f"[console_scripts]\n{dist} = {name}:main\n")
        zf.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return path


def test_installer_without_pip_unpacks_a_stable_abi_wheel(tmp_path: Path) -> None:
    """A Python without pip (a venv made --without-pip): the fallback unpacks the cp39-abi3 wheel;
    it then reports megatron-core and NVRx missing (that venv has neither) and exits 1."""
    python = tmp_path / "nopip" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "nopip")], check=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _tiny_wheel(wheels, "cp39-abi3-manylinux_2_17_x86_64", name="rp_abi3probe")
    target = tmp_path / "site"
    script = REPO / "scripts" / "install_carried_wheels.py"
    proc = subprocess.run([str(python), str(script), str(wheels), str(target)], capture_output=True, text=True)
    installed = json.loads((target / "installed.json").read_text())
    assert (
        installed["rp-abi3probe"]["action"]
        == "installed (rp_abi3probe-1.0-cp39-abi3-manylinux_2_17_x86_64.whl, unpacked)"
    )
    assert installed["rp-abi3probe"]["now"] == "1.0" and (target / "rp_abi3probe" / "__init__.py").is_file()
    assert proc.returncode == 1 and "megatron-core, nvidia-resiliency-ext not installed; fix:" in proc.stderr


def test_installer_installs_offline_into_a_target(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _tiny_wheel(wheels)
    target = tmp_path / "site"
    script = REPO / "scripts" / "install_carried_wheels.py"
    proc = subprocess.run([sys.executable, str(script), str(wheels), str(target)], capture_output=True, text=True)
    # megatron-core and NVRx come from this environment here (present), the probe from the wheel
    assert proc.returncode == 0, proc.stderr
    installed = json.loads((target / "installed.json").read_text())
    assert installed["rp-probe"]["action"].startswith("installed") and installed["rp-probe"]["now"] == "1.0"
    assert (target / "rp_probe" / "__init__.py").is_file()
    unpacked = tmp_path / "unpacked"
    unpack(_tiny_wheel(wheels), unpacked)
    out = subprocess.run([str(unpacked / "bin" / "rp-probe")], env={"PYTHONPATH": str(unpacked)}, capture_output=True)
    assert out.stdout.decode().strip() == "probe ok"
