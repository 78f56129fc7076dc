"""Corrupt or partial checkpoints are detected, reported in one line naming the file, skipped with
fallback to the next older verified step, and quarantined. Real checkpoints, real corruption."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import copy_tree, events, flip_byte, metrics_by_step, overrides_for, torchrun
from tests.suite_cache import built_once
from tiering.collective import SingleProcess
from tiering.errors import VerificationError
from tiering.local.posix import PosixTier
from tiering.local.restore import select_newest_verified
from tiering.manifest import Manifest
from tiering.verify import committed_marker, verify_step

STEP30 = "t/steps/step-000000030"


# Reshardable tier only, a step every 10, all three kept.
RESHARDABLE_ONLY = {
    "checkpoint.local.enabled": "false",
    "checkpoint.reshardable.interval": 10,
    "checkpoint.reshardable.keep": 3,
}


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A real 2-rank run with committed reshardable steps 10, 20 and 30 (one for the whole test run:
    the tests copy it); returns that tier's root."""

    def run(job: Path) -> None:
        torchrun(job, 2, overrides_for(job, corpus, **RESHARDABLE_ONLY, **{"train.steps": 30}))

    return built_once(tmp_path_factory, "bad-input-trained", run) / "reshard"


@pytest.fixture
def ckpt(trained: Path, tmp_path: Path) -> Path:
    return copy_tree(trained, tmp_path / "ckpt")


def _rewrite_manifest(step_dir: Path, edit: Callable[[dict], None]) -> None:
    """Edit the manifest and re-bind COMMITTED to it, so only the edited field is wrong."""
    body = json.loads((step_dir / "manifest.json").read_text())
    edit(body)
    raw = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    (step_dir / "manifest.json").write_bytes(raw)
    (step_dir / "COMMITTED").write_bytes(committed_marker(body["step"], raw))


def _first_path(body: dict, value: str) -> None:
    body["files"][0]["path"] = value


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte in model shard": (lambda d: flip_byte(d / "model" / "__0_0.distcp"), "model/__0_0.distcp"),
    "flipped byte in dcp metadata": (lambda d: flip_byte(d / "model" / ".metadata"), "model/.metadata"),
    "flipped byte in megatron common.pt": (lambda d: flip_byte(d / "model" / "common.pt"), "model/common.pt"),
    "flipped byte in trainer state": (lambda d: flip_byte(d / "trainer.pt"), "trainer.pt"),
    "flipped byte in rank state": (lambda d: flip_byte(d / "rank-state" / "rank-00001.pt"), "rank-00001.pt"),
    "truncated shard": (lambda d: os.truncate(d / "model" / "__0_1.distcp", 1000), "model/__0_1.distcp"),
    "missing shard": (lambda d: (d / "model" / "__0_1.distcp").unlink(), "model/__0_1.distcp"),
    "missing COMMITTED": (lambda d: (d / "COMMITTED").unlink(), "COMMITTED"),
    "empty manifest": (lambda d: (d / "manifest.json").write_bytes(b""), "manifest.json"),
    "garbage manifest": (lambda d: (d / "manifest.json").write_bytes(b"\x00garbage{"), "manifest.json"),
    "manifest edited after commit": (
        lambda d: (d / "manifest.json").write_text(
            (d / "manifest.json").read_text().replace('"step": 30', '"step": 29')
        ),
        "COMMITTED",
    ),
    "manifest path with ..": (
        lambda d: _rewrite_manifest(d, lambda b: _first_path(b, "../step-000000020/trainer.pt")),
        "manifest.json",
    ),
    "manifest absolute path": (
        lambda d: _rewrite_manifest(d, lambda b: _first_path(b, "/etc/passwd")),
        "manifest.json",
    ),
    "symlink in step dir": (
        lambda d: (
            (d / "rank-state" / "rank-00000.pt").unlink()
            or os.symlink("/etc/hostname", d / "rank-state" / "rank-00000.pt")
        ),
        "rank-00000.pt",
    ),
    "unlisted extra file": (lambda d: (d / "model" / "extra.bin").write_bytes(b"x"), "model/extra.bin"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_newest_step_falls_back_and_is_quarantined(ckpt: Path, name: str) -> None:
    corrupt, names_file = CORRUPTIONS[name]
    corrupt(ckpt / STEP30)
    with pytest.raises(VerificationError) as err:
        verify_step(ckpt / STEP30, expect_run_id="t")
    message = str(err.value)
    assert "\n" not in message and names_file in message, message

    tier = PosixTier(ckpt, "t", keep=3)
    selection = select_newest_verified(tier, SingleProcess())
    assert selection is not None and selection.step == 20, "must fall back to the next older verified step"
    assert [s for s, _ in selection.rejected] == [30]
    assert not (ckpt / STEP30).exists()
    quarantined = list((ckpt / "t" / "quarantine").glob("step-000000030.*"))
    dirs = [p for p in quarantined if p.is_dir()]
    reasons = [p for p in quarantined if p.name.endswith(".reason.txt")]
    assert len(dirs) == 1 and len(reasons) == 1, "the bad step is kept for inspection, not deleted"
    assert names_file in reasons[0].read_text()


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"step": "thirty"}', b'{"step": 999}'])
def test_bad_latest_json_is_only_a_hint(ckpt: Path, content: bytes) -> None:
    (ckpt / "t" / "latest.json").write_bytes(content)
    selection = select_newest_verified(PosixTier(ckpt, "t"), SingleProcess())
    assert selection is not None and selection.step == 30 and selection.rejected == []


def test_stale_latest_json_does_not_hide_newer_step(ckpt: Path) -> None:
    (ckpt / "t" / "latest.json").write_text('{"step": 10, "path": "steps/step-000000010"}')
    selection = select_newest_verified(PosixTier(ckpt, "t"), SingleProcess())
    assert selection is not None and selection.step == 30


def test_every_step_corrupt_means_no_checkpoint(ckpt: Path) -> None:
    for step in (10, 20, 30):
        flip_byte(ckpt / "t" / "steps" / f"step-{step:09d}" / "trainer.pt")
    assert select_newest_verified(PosixTier(ckpt, "t"), SingleProcess()) is None
    assert len(list((ckpt / "t" / "quarantine").glob("*.reason.txt"))) == 3


def test_manifest_from_another_run_is_rejected(ckpt: Path) -> None:
    _rewrite_manifest(ckpt / STEP30, lambda b: b.update(run_id="someone-else"))
    with pytest.raises(VerificationError, match="someone-else"):
        verify_step(ckpt / STEP30, expect_run_id="t")


def test_manifest_roundtrip_matches_files(ckpt: Path) -> None:
    manifest = Manifest.from_json((ckpt / STEP30 / "manifest.json").read_bytes(), "m")
    listed = {f.path for f in manifest.files}
    on_disk = {p.relative_to(ckpt / STEP30).as_posix() for p in (ckpt / STEP30).rglob("*") if p.is_file()}
    assert on_disk - listed == {"manifest.json", "COMMITTED", "SIGNATURE"}  # the three bind each other
    assert {"trainer.pt", "rank-state/rank-00000.pt", "rank-state/rank-00001.pt", "model/metadata.json"} <= listed
    assert manifest.world_size == 2 and manifest.parallelism == {"tp": 1, "pp": 1, "dp": 2}
    assert manifest.dataset_snapshot.startswith("sha256:") and manifest.framework["megatron-core"]


@pytest.mark.slow
def test_trainer_skips_corrupt_newest_step_and_resumes_from_older(trained: Path, tmp_path: Path, corpus: Path) -> None:
    job = tmp_path / "job"
    copy_tree(trained, job / "reshard")
    # The steps are signed with the run's key: the copied run keeps its key, as a moved run would.
    (job / "runs" / "t").mkdir(parents=True)
    shutil.copy2(trained.parent / "runs" / "t" / "run.key", job / "runs" / "t" / "run.key")
    flip_byte(job / "reshard" / STEP30 / "model" / "__0_1.distcp")
    torchrun(
        job,
        2,
        overrides_for(
            job,
            corpus,
            **RESHARDABLE_ONLY,
            **{"train.steps": 40},
        ),
    )
    restore = [e for e in events(job / "runs" / "t") if e["event"] == "restore"]
    assert restore[0]["step"] == 20
    assert restore[0]["rejected"][0]["step"] == 30 and "__0_1.distcp" in restore[0]["rejected"][0]["reason"]
    assert min(metrics_by_step(job / "runs" / "t")) == 21, "first step after restore is manifest step + 1"
    assert (job / "reshard" / "t" / "steps" / "step-000000040" / "COMMITTED").is_file()
    assert list((job / "reshard" / "t" / "quarantine").glob("step-000000030.*.reason.txt"))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return os.system(f"mount -t tmpfs -o size={size} tmpfs {path} 2>/dev/null") == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "saved", "failed", "message"),
    [
        # The previous step's size predicts the next save will not fit: refused up front.
        ("9m", [5], [10, 15], "not enough free space"),
        # The first save has no estimate: the writers hit ENOSPC mid-write and the step is aborted.
        ("3m", [], [5, 10, 15], "failed to write its part"),
    ],
)
def test_full_disk_fails_the_save_cleanly_and_keeps_older_steps(
    tmp_path: Path, corpus: Path, size: str, saved: list[int], failed: list[int], message: str
) -> None:
    job = tmp_path / "job"
    disk = job / "reshard"
    if not _mount_tmpfs(disk, size):
        pytest.skip("needs root to mount a small tmpfs as a full disk")
    try:
        torchrun(
            job,
            2,
            overrides_for(
                job,
                corpus,
                **{**RESHARDABLE_ONLY, "checkpoint.reshardable.interval": 5},  # every save the same size
                **{"train.steps": 15},
            ),
        )
        ev = events(job / "runs" / "t")
        assert [e["step"] for e in ev if e["event"] == "save"] == saved
        errors = [e for e in ev if e["event"] == "save_failed"]
        assert [e["step"] for e in errors] == failed
        assert message in errors[0]["error"] and "older steps are intact" in errors[0]["error"]
        assert "\n" not in errors[0]["error"]
        assert max(metrics_by_step(job / "runs" / "t")) == 15, "training goes on after a failed save"
        steps = sorted(p.name for p in (disk / "t" / "steps").iterdir())
        assert steps == [f"step-{s:09d}" for s in saved], f"no temporary or partial step may remain: {steps}"
        for step in saved:
            verify_step(disk / "t" / "steps" / f"step-{step:09d}", expect_run_id="t")
    finally:
        os.system(f"umount {disk}")
        shutil.rmtree(disk, ignore_errors=True)
