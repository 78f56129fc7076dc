"""``tiering ls`` and ``tiering verify`` on real published steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers import PYTHON, REPO
from tests.test_publish import _publish
from tiering.collective import SingleProcess
from tiering.digest import HashSpec
from tiering.layout import RunLayout
from tiering.local.publish import PosixStepPublisher, manifest_for


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


def _framework(image_digest: str | None) -> dict[str, str]:
    """framework_versions() as the rank program records it, in a process with or without IMAGE_DIGEST."""
    env = {k: v for k, v in os.environ.items() if k != "IMAGE_DIGEST"}
    if image_digest is not None:
        env["IMAGE_DIGEST"] = image_digest
    code = (
        "import json; from pretrain.platform.versions import framework_versions; "
        "print(json.dumps(framework_versions()))"
    )
    out = subprocess.run([PYTHON, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_ls_shows_the_image_each_step_was_written_from(tmp_path: Path) -> None:
    digest = "sha256:" + "0123456789abcdef" * 4
    in_image, outside = _framework(digest), _framework(None)
    assert in_image["image_digest"] == digest and outside["image_digest"] == "unknown"
    assert {"torch", "cuda", "megatron-core", "nvidia-resiliency-ext", "transformer-engine"} <= set(in_image)
    pub = PosixStepPublisher(RunLayout(tmp_path, "run"), SingleProcess(), "a1")
    for step, framework in ((1, in_image), (2, outside)):
        tmp = pub.begin(step)
        (tmp / "trainer.pt").write_bytes(b"state")
        pub.commit(tmp, manifest_for("run", step, 1, {"tp": 1, "pp": 1, "dp": 1}, framework=framework))
    out = _tiering("ls", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "IMAGE" in out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert rows["1"][5] == "sha256:0123456789ab" and rows["2"][5] == "unknown"
    listed = json.loads(_tiering("ls", str(tmp_path / "run"), "--json").stdout)[0]["steps"]
    assert {s["step"]: s["image"] for s in listed} == {1: digest, 2: "unknown"}


def test_verify_and_ls_name_the_hash_each_step_was_checked_with(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path, "run")
    for step, name in ((1, "xxh3-128"), (2, "blake3")):
        pub = PosixStepPublisher(layout, SingleProcess(), "a1", hashing=HashSpec(name=name))
        tmp = pub.begin(step)
        (tmp / "trainer.pt").write_bytes(b"state" * 100)
        pub.commit(tmp, manifest_for("run", step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    v1 = tmp_path / "v1"  # format v1 (one SHA-256 per file), written before chunked digests
    shutil.copytree(Path(__file__).parent / "fixtures" / "manifest-v1" / "t", v1 / "t")
    v1_step = v1 / "t" / "ranks" / "rank-00000" / "steps" / "step-000000010"
    for step_dir, name in ((layout.step_dir(1), "xxh3-128"), (layout.step_dir(2), "blake3"), (v1_step, "sha256")):
        out = _tiering("verify", str(step_dir))
        assert out.returncode == 0 and f", {name} ok (" in out.stdout, out.stdout
    listed = _tiering("ls", str(tmp_path / "run"))
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert rows["1"][-2:] == ["xxh3-128", "yes"] and rows["2"][-2:] == ["blake3", "yes"], listed.stdout
