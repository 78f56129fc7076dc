"""The prepared single-GPU check cannot rot: ``scripts/gpu-check.sh --cpu`` runs the same entry
points (training with an in-process kill and restart, the reshard load at 2 gloo ranks, the
snapshot benchmark, the version and ft_launcher-flag checks) at CPU size in make test (the main
pytest run collects tests/gpu/ too, in its default GPU mode: without CUDA every test there skips);
the offline wheel installer picks wheels by interpreter and glibc and installs them into a target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from install_carried_wheels import fits, unpack  # noqa: E402  (a script, not a package)

GPU_TESTS = {
    "test_versions_that_ran",
    "test_ft_launcher_accepts_every_flag_we_pass",
    "test_train_kill_restart_resumes_exactly",
    "test_reshardable_checkpoint_loads_on_cpu_at_tp2",
    "test_background_save_blocks_less_than_a_sync_save",
}


def _gpu_check(tmp: Path, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp / "report.json"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp)}
    cmd = [str(REPO / "scripts" / "gpu-check.sh"), *args, "--report", str(report), "--workdir", str(tmp / "work")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert report.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(report.read_text())


def test_cpu_dry_run_of_the_gpu_check(tmp_path: Path) -> None:
    proc, report = _gpu_check(tmp_path, "--cpu", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["mode"] == "cpu" and set(report["tests"]) == GPU_TESTS
    assert {t["outcome"] for t in report["tests"].values()} == {"passed"}, report["tests"]
    assert report["versions"]["megatron-core"] and report["versions"]["torch"]
    train = report["tests"]["test_train_kill_restart_resumes_exactly"]["figures"]
    assert train["comparison"]["identical"] and train["spec"] == "local", train
    assert train["restored"][-1]["tier"] == "local"
    reshard = report["tests"]["test_reshardable_checkpoint_loads_on_cpu_at_tp2"]["figures"]
    assert reshard["all_equal"] and reshard["layout"]["tp"] == 2 and reshard["optimizer_keys"] > 0
    bench = report["tests"]["test_background_save_blocks_less_than_a_sync_save"]["figures"]
    assert 0 < bench["blocked_ratio"] < 1 and bench["snapshot"]["gb_per_s"] > 0


def test_wheels_are_picked_by_interpreter_and_glibc() -> None:
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    glibc = tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[-1].split("."))
    assert fits(Path("tqdm-4.70.1-py3-none-any.whl"))
    assert fits(Path(f"x-1.0-{here}-{here}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"))
    newer = f"{glibc[0]}_{glibc[1] + 1}"
    assert not fits(Path(f"nvidia_resiliency_ext-0.7.0-{here}-{here}-manylinux_{newer}_x86_64.whl"))
    assert not fits(Path("megatron_core-0.19.2-cp399-cp399-manylinux_2_28_x86_64.whl"))


def _tiny_wheel(wheels: Path) -> Path:
    path = wheels / "rp_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("rp_probe/__init__.py", "def main() -> int:\n    print('probe ok')\n    return 0\n")
        zf.writestr("rp_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: rp-probe\nVersion: 1.0\n")
        zf.writestr("rp_probe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("rp_probe-1.0.dist-info/entry_points.txt", "[console_scripts]\nrp-probe = rp_probe:main\n")
        zf.writestr("rp_probe-1.0.dist-info/RECORD", "")
    return path


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
