"""``tiering ls`` and ``tiering verify`` on real published steps."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers import PYTHON
from tests.test_publish import _publish


def _tiering(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tiering", *args], capture_output=True, text=True, timeout=60)


def test_verify_exit_codes(tmp_path: Path) -> None:
    step_dir = _publish(tmp_path, 3)
    ok = _tiering("verify", str(step_dir))
    assert ok.returncode == 0 and "verified" in ok.stdout and "step 3" in ok.stdout
    data = bytearray((step_dir / "model" / "shard.bin").read_bytes())
    data[0] ^= 1
    (step_dir / "model" / "shard.bin").write_bytes(bytes(data))
    bad = _tiering("verify", str(step_dir))
    assert bad.returncode == 1
    assert bad.stdout.count("\n") == 1 and "model/shard.bin" in bad.stdout and "chunk 0 of 1" in bad.stdout


def test_ls_shows_state_size_age_and_verification(tmp_path: Path) -> None:
    _publish(tmp_path, 1)
    _publish(tmp_path, 2)
    (tmp_path / "run" / "steps" / "step-000000002" / "COMMITTED").unlink()
    out = _tiering("ls", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert "committed" in rows["1"] and rows["1"].rstrip().endswith("yes") and "KiB" in rows["1"]
    assert "uncommitted" in rows["2"] and "NO: " in rows["2"] and "COMMITTED" in rows["2"]
    root = _tiering("ls", str(tmp_path), "--json")
    assert root.returncode == 0 and '"step": 2' in root.stdout
    missing = _tiering("ls", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no run directory" in missing.stderr
