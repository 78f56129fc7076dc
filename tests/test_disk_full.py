"""A full tier-1 disk is handled, not only survived: a save that does not fit first drops the tier's
steps down to the newest verified one; one that still cannot fit is refused in one line naming the
path and the bytes (and counted with reason ``disk_full``); a write that fills the disk half-way is
reported as the file system's ENOSPC, never as torch's zip-writer wording. A programming error inside
a save is not a storage failure: it fails the attempt.

The volumes are real tmpfs mounts (root), unmounted even when a test fails.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from pretrain.checkpointing.async_writer import BackgroundWrite, save_state
from pretrain.checkpointing.rank_payload import load_verified_state, owned_tensors
from pretrain.checkpointing.reporting import failure_reason
from pretrain.observability.metrics import TrainingMetrics
from tests.helpers import events, overrides_for, tmpfs, torchrun
from tiering.collective import SingleProcess
from tiering.errors import DiskFull, PublishError
from tiering.local.posix import PosixTier
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.system.fsio import write_file_durably

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")


def _publish(publisher: PosixStepPublisher, step: int, size: int) -> None:
    tmp = publisher.begin(step)
    (tmp / "state.pt").write_bytes(b"\0" * size)
    publisher.commit(tmp, manifest_for("t", step, 1, {"tp": 1, "pp": 1, "dp": 1}))


def test_a_write_that_fills_the_disk_reports_enospc_naming_the_file(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", 2) as vol, pytest.raises(OSError) as err:
        write_file_durably(vol / "state.pt", lambda fh: save_state({"w": torch.zeros(1 << 20)}, fh))
    assert err.value.errno == errno.ENOSPC, err.value
    assert "state.pt" in str(err.value) and "unexpected pos" not in str(err.value)


def test_a_save_short_of_space_drops_older_steps_first_then_refuses_in_one_line(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "vol", 8) as vol:
        tier = PosixTier(vol, "t", keep=3)
        publisher = PosixStepPublisher(tier.layout, SingleProcess(), "attempt-01-x")
        for step in (10, 20, 30):
            _publish(publisher, step, 2 << 20)
        tmp = publisher.begin(40, expected_bytes=3 << 20, make_room=tier.make_room)
        assert tier.committed_steps() == [30], "dropped down to the newest step, which is kept"
        assert tmp.is_dir()
        tmp.rmdir()
        with pytest.raises(DiskFull) as err:
            publisher.begin(40, expected_bytes=7 << 20, make_room=tier.make_room)
    line = str(err.value)
    assert "\n" not in line and "disk full" in line and str(vol) in line and "fix:" in line
    assert "7340032" in line, line  # the bytes needed


def test_a_restored_optimizer_keeps_no_mapping_of_the_step_so_deleting_it_frees_its_space(tmp_path: Path) -> None:
    """Tier 1 loads a verified step mapped (no second read); a CPU optimizer given those tensors
    would keep the file mapped for the life of the rank, and pruning that step on a full volume
    would free nothing (found by the soak: a full tier 1 whose pruning failed on the file still in use)."""
    model = torch.nn.Linear(64, 64)
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    adam.step()
    path = tmp_path / "state.pt"
    torch.save({"optimizer": adam.state_dict()}, path)
    restored = torch.optim.AdamW(model.parameters())
    mapped = load_verified_state(path)
    assert str(path) in Path("/proc/self/maps").read_text(), "the load is expected to map the file"
    restored.load_state_dict(owned_tensors(mapped["optimizer"]))
    del mapped
    assert str(path) not in Path("/proc/self/maps").read_text(), "the restored optimizer still maps the step"
    want = adam.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"], want)


def test_a_programming_error_in_a_writer_is_raised_not_reported_as_a_failed_save(tmp_path: Path) -> None:
    for mode in ("thread", "fork"):
        write = BackgroundWrite(mode, {"x": torch.ones(3)}, tmp_path / f"{mode}.pt", fault="bug")
        write.wait_for_snapshot()
        with pytest.raises((TypeError, RuntimeError), match="injected programming error"):
            write.poll(block=True)
    io_failure = BackgroundWrite("thread", {"x": torch.ones(3)}, tmp_path / "io.pt", fault="fail")
    outcome = io_failure.poll(block=True)
    assert outcome is not None and not outcome.ok and "injected writer failure" in (outcome.error or "")


def test_a_disk_full_save_is_counted_with_its_reason() -> None:
    metrics = TrainingMetrics("r")
    for exc in (DiskFull("/nvme/steps: disk full: 1 bytes free"), OSError(28, "No space left on device")):
        metrics.save_failed("local", failure_reason(exc))
    metrics.save_failed("local", failure_reason(PublishError("rank 1: background writer was killed by signal 9")))
    exported = generate_latest(_Registry(metrics)).decode()
    assert 'checkpoint_save_failures_total{reason="disk_full",run_id="r",tier="local"} 2.0' in exported, exported
    assert 'checkpoint_save_failures_total{reason="error",run_id="r",tier="local"} 1.0' in exported, exported


class _Registry:
    """What ``generate_latest`` needs: the collector's families."""

    def __init__(self, metrics: TrainingMetrics) -> None:
        self.metrics = metrics

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        return self.metrics.collect()


@pytest.mark.slow
def test_a_full_tier1_volume_prunes_and_moves_on_and_a_writer_bug_fails_the_attempt(
    tmp_path: Path, corpus: Path
) -> None:
    """2 ranks, each holding its own step and the other's replica (~22 MB a step on the node): a
    64 MB volume holds two steps, not the three ``keep`` asks for; the saves drop older steps and
    tier 1 keeps moving (its newest step is the final one). Then a TypeError in rank 0's writer
    ends the attempt as a user error, while the disk-full saves before it did not."""
    job = tmp_path / "full"
    with tmpfs(tmp_path / "nvme", 64) as vol:
        extra = {"train.steps": 20, "checkpoint.local.interval": 5, "checkpoint.local.dir": str(vol)}
        torchrun(job, 2, [*overrides_for(job, corpus), *[f"{k}={v}" for k, v in extra.items()]])
        rank0 = PosixTier(vol / "t" / "ranks", "rank-00000", run_id="t")
        newest = rank0.committed_steps()
    assert newest[:1] == [20], newest
    recorded = events(job / "runs" / "t")
    assert not [e for e in recorded if e.get("event") == "save_failed"]
    assert "dropped older steps" in (job / "job.log").read_text()
    room = [e for e in recorded if e.get("event") == "room_made"]  # what an operator (and the soak) sees
    assert room and all(e["tier"] == "local" and e["reason"] == "disk_full" and e["dropped"] for e in room), room

    bug = tmp_path / "bug"
    faults = {"fault_tolerance.inject.writer_fault": "bug", "fault_tolerance.inject.writer_fault_at_step": 10}
    steps = {"train.steps": 15, "checkpoint.local.interval": 5}  # the faulty save is not the first
    proc = torchrun(bug, 2, overrides_for(bug, corpus, **steps, **faults), check=False)
    assert proc.returncode != 0
    (path,) = (bug / "runs" / "t" / "attempts").glob("attempt-*.json")
    record = json.loads(path.read_text())
    assert record["failure"]["classification"] == "user", record["failure"]
    assert "injected programming error" in json.dumps(record["failure"]), record["failure"]
