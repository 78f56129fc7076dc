"""Node-local tier roots are private: created 0700, a loose one of ours tightened, and a symlink, a
file, or a directory another user created first (a squatter) refused with one line and the fix,
its contents left alone; the processes the project starts run under umask 077."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tiering.errors import UnsafeDirectory
from tiering.system.private_dir import private_dir

OTHER_UID = 4242  # a user that is not this one (the squatter)


def test_a_new_root_is_0700_and_a_loose_one_of_ours_is_tightened(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "shm" / "run-a")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == os.getuid()
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    private_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_a_symlink_or_a_file_where_the_root_belongs_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    target.chmod(0o755)  # whatever umask an earlier test left: the mode a chmod through the link would change
    link = tmp_path / "run-a"
    link.symlink_to(target)
    with pytest.raises(UnsafeDirectory) as err:
        private_dir(link)
    assert "a symlink where a private directory belongs; fix:" in str(err.value) and "\n" not in str(err.value)
    assert link.is_symlink() and stat.S_IMODE(target.stat().st_mode) != 0o700, "what the link names is untouched"
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        private_dir(tmp_path / "plain")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_root_squatted_by_another_user_is_refused_and_left_alone() -> None:
    base = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="squat-"))  # pytest's tmp dirs are root's 0700
    base.chmod(0o755)
    try:
        _squatted(base)
    finally:
        shutil.rmtree(base)


def _squatted(tmp_path: Path) -> None:
    squat = tmp_path / "run-a"
    squat.mkdir()
    (squat / "planted").write_text("slot of the squatter")
    os.chown(squat, OTHER_UID, OTHER_UID)
    squat.chmod(0o777)
    code = (
        "import os, sys; from tiering.system.private_dir import private_dir; os.setuid(4343); "
        f"private_dir(__import__('pathlib').Path({str(squat)!r}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "owned by uid 4242, not 4343" in run.stderr and "fix:" in run.stderr, run.stderr
    assert (squat / "planted").read_text() == "slot of the squatter", "nothing of the squatter's is touched"
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chown(parent, OTHER_UID, OTHER_UID)
    parent.chmod(0o777)
    code = (
        "import os; from tiering.system.private_dir import private_dir; os.setuid(4343); "
        f"private_dir(__import__('pathlib').Path({str(parent / 'run-a')!r}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "writable by others, who may replace" in run.stderr, run.stderr


def test_the_pretrain_and_tiering_commands_run_under_umask_077(tmp_path: Path) -> None:
    probe = "import os; m = os.umask(0); print(oct(m))"
    for module in ("pretrain.cli", "tiering.commands.main"):
        code = f"import {module} as c\ntry: c.main(['--help'])\nexcept SystemExit: pass\n{probe}"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.stdout.strip().splitlines()[-1] == "0o77", (module, out.stdout[-200:], out.stderr[-500:])
