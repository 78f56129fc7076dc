"""The publish protocol, retention and quarantine on real files (single process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiering.collective import SingleProcess
from tiering.errors import PublishError
from tiering.layout import RunLayout
from tiering.local.posix import PosixTier
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.retention import KeepNewest
from tiering.verify import verify_step


def _publish(root: Path, step: int, attempt: str = "a1", payload: bytes = b"x" * 1000) -> Path:
    layout = RunLayout(root, "run")
    pub = PosixStepPublisher(layout, SingleProcess(), attempt)
    tmp = pub.begin(step)
    (tmp / "model").mkdir()
    (tmp / "model" / "shard.bin").write_bytes(payload)
    (tmp / "trainer.pt").write_bytes(b"state")
    pub.commit(tmp, manifest_for("run", step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    return layout.step_dir(step)


def test_publish_writes_manifest_marker_and_latest(tmp_path: Path) -> None:
    step_dir = _publish(tmp_path, 5)
    manifest = verify_step(step_dir, expect_run_id="run")
    assert {f.path for f in manifest.files} == {"model/shard.bin", "trainer.pt"}
    assert next(f for f in manifest.files if f.path == "model/shard.bin").bytes == 1000
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 5
    assert json.loads((step_dir / "COMMITTED").read_text())["step"] == 5
    assert not list((tmp_path / "run" / "steps").glob("*.tmp-*"))


def test_published_step_is_never_overwritten(tmp_path: Path) -> None:
    step_dir = _publish(tmp_path, 5)
    before = (step_dir / "manifest.json").read_bytes()
    with pytest.raises(PublishError, match="immutable"):
        _publish(tmp_path, 5, attempt="a2", payload=b"y" * 10)
    assert (step_dir / "manifest.json").read_bytes() == before
    verify_step(step_dir)


def test_failed_rank_aborts_without_publishing(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path, "run")
    pub = PosixStepPublisher(layout, SingleProcess(), "a1")
    tmp = pub.begin(7)
    (tmp / "half.bin").write_bytes(b"partial")
    with pytest.raises(PublishError, match="rank 0 failed to write its part"):
        pub.commit(tmp, manifest_for("run", 7, 1, {}), local_error="OSError: boom")
    assert not tmp.exists() and not layout.step_dir(7).exists() and not layout.latest_path.exists()


def test_retention_keeps_newest_and_never_the_only_good_copy(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        _publish(tmp_path, step)
    tier = PosixTier(tmp_path, "run", keep=2)
    assert tier.apply_retention() == [10, 20]
    assert tier.committed_steps() == [40, 30]
    # A newer step that does not verify structurally is not counted as a kept copy.
    (tier.step_path(40) / "COMMITTED").write_text("garbage")
    assert tier.apply_retention() == []
    assert tier.committed_steps() == [40, 30]


def test_retention_policy_rules() -> None:
    assert KeepNewest(1).deletable([]) == []
    assert KeepNewest(0).deletable([5]) == [], "the newest verified step is never deletable"
    assert KeepNewest(2).deletable([1, 2, 3, 4]) == [1, 2]
    assert KeepNewest(1).deletable([1, 2, 3], protected=[1]) == [2]


def test_stale_tmp_dirs_of_dead_attempts_are_removed(tmp_path: Path) -> None:
    _publish(tmp_path, 10)
    steps = tmp_path / "run" / "steps"
    (steps / "step-000000020.tmp-attempt-00-dead").mkdir()
    (steps / "step-000000020.tmp-attempt-01-live").mkdir()
    removed = PosixTier(tmp_path, "run").clean_stale_tmp("attempt-01-live")
    assert [p.name for p in removed] == ["step-000000020.tmp-attempt-00-dead"]
    assert (steps / "step-000000020.tmp-attempt-01-live").exists() and (steps / "step-000000010").exists()


def test_uncommitted_step_dir_is_not_loadable(tmp_path: Path) -> None:
    step_dir = _publish(tmp_path, 10)
    os.unlink(step_dir / "COMMITTED")
    tier = PosixTier(tmp_path, "run")
    assert tier.committed_steps() == [] and tier.step_dirs() == [10]
