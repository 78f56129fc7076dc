"""End to end: a 2-rank job under ft_launcher whose reshardable tier (shared storage in production:
NFS, Lustre) stops answering keeps training, and a restart never waits on it.

``checkpoint.reshardable.dir`` is a real FUSE mount (``pretrain/soak/gated_fs.py``) whose data writes
block in the kernel while its gate is closed:

1. Once step 20 is published there, the shard files (``.distcp``) and the storage probes stall:
   the writers Megatron forks block, the small files beside them still answer. The save is
   abandoned once a writer wrote nothing for the deadline (3 s) and a probe then went unanswered
   as long, recorded with reason ``stalled``, and training goes on in the same attempt; the gate
   opens and a later save is published again.
2. Then every write there stalls. The next save of the tier holds the ranks' own threads in the
   kernel (its small files are written there); the checkpointing section's timeout (5 s here)
   has the rank monitor SIGKILL them, which the kernel holds up: the standby process tells the
   launcher they ended, and the job restarts instead of waiting on the storage. The new
   attempt's probe of the storage does not answer, so its restore takes tier 1 without touching
   the tier (saying so), its saves of the tier are skipped, and the job ends while the storage
   still stalls. What the kernel held (ranks, writers, probes) exits once the storage answers.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pretrain.commands.ft_command import ft_launcher_command
from tests.helpers import REPO, TINY, events, job_env, overrides_for, read_jsonl
from tests.test_stalled_storage_job import _processes_with, _wait_for

pytest.importorskip("fuse", reason="fusepy missing: pip install -e '.[test]'")

from pretrain.soak.storage import GatedMount  # noqa: E402

pytestmark = pytest.mark.slow

STALL_S = 3.0
SETTINGS = {
    "train.steps": 160,
    "checkpoint.local.interval": 5,
    "checkpoint.reshardable.interval": 20,
    "checkpoint.reshardable.stall_timeout_s": STALL_S,
    "checkpoint.reshardable.probe_interval_s": 0.5,
}


def _events(run: Path, **match: Any) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    rows = read_jsonl(path) if path.exists() else []
    return [e for e in rows if all(e.get(k) == v for k, v in match.items())]


def _reshardable_saves(run: Path) -> list[int]:
    return [e["step"] for e in _events(run, event="save", tier="reshardable")]


def _stalls(run: Path) -> list[dict[str, Any]]:
    return _events(run, event="save_failed", tier="reshardable", reason="stalled")


def _ft_config(tmp: Path) -> Path:
    """The shipped sections config with a 5 s checkpointing timeout (a tiny save takes well under 1 s)."""
    cfg = yaml.safe_load((REPO / "configs" / "ft-cpu-sections.yaml").read_text())
    cfg["fault_tolerance"]["rank_section_timeouts"]["checkpointing"] = 5.0
    path = tmp / "ft-sections-5s.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_job_whose_reshardable_storage_stalls_trains_on_and_restarts_without_waiting_on_it(
    tmp_path: Path, corpus: Path
) -> None:
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root to mount a FUSE file system")
    job = tmp_path / "job"
    run = job / "runs" / "t"
    mount = GatedMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "gate", tmp_path / "fuse.log")
    proc: subprocess.Popen[bytes] | None = None
    try:
        overrides = overrides_for(job, corpus, **SETTINGS, **{"checkpoint.reshardable.dir": str(mount.mountpoint)})
        cmd = ft_launcher_command(TINY, nproc=2, ft_config=_ft_config(tmp_path), max_restarts=3, overrides=overrides)
        env = job_env(job, shared_standby=False)  # its processes are found by their environment
        with (job / "job.log").open("wb") as log:
            proc = subprocess.Popen(cmd, cwd=job, env=env, stdout=log, stderr=subprocess.STDOUT)
        _wait_for("reshardable step 20", lambda: 20 in _reshardable_saves(run), proc, 120)
        mount.close(only=(".distcp", ".probe-"))
        _wait_for("the stall to be recorded", lambda: bool(_stalls(run)), proc, 60)
        mount.open()
        stalled = _stalls(run)[0]
        _wait_for("a save after the stall", lambda: max(_reshardable_saves(run)) > stalled["step"], proc, 60)
        mount.close()
        assert proc.wait(timeout=180) == 0, (job / "job.log").read_text()[-4000:]
        stuck = _processes_with(f"TMPDIR={env['TMPDIR']}")
        mount.open()
        deadline = time.monotonic() + 15
        while _processes_with(f"TMPDIR={env['TMPDIR']}") and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = _processes_with(f"TMPDIR={env['TMPDIR']}")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        mount.stop()

    ev = events(run)
    attempts = sorted({e["attempt"] for e in ev if e["event"] == "start"})
    assert len(attempts) == 2, f"only the hang in the stalled save restarted the job: {attempts}"
    first, second = attempts

    # 1. The stalled write was abandoned at its deadline; training and tier 1 went on, no restart.
    assert stalled["attempt"] == first and "wrote nothing" in stalled["error"], stalled
    assert "probe of the storage went unanswered" in stalled["error"], stalled
    later_local = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local" and e["attempt"] == first]
    assert max(later_local) > stalled["step"] + 5, "tier 1 kept saving while the reshardable tier stalled"
    resumed = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "reshardable" and e["attempt"] == first]
    assert max(resumed) > stalled["step"], "the tier was published to again once the storage answered"

    # 2. The restart's restore never waited on the stalled tier, and its saves were skipped.
    restore = next(e for e in ev if e["event"] == "restore" and e["attempt"] == second)
    assert restore["tier"] == "local", restore
    assert any(n.startswith("reshardable tier skipped: rank") for n in restore["notes"]), restore
    assert restore["seconds"] < STALL_S, restore
    skipped = [e for e in ev if e["event"] == "save_skipped" and e["tier"] == "reshardable" and e["attempt"] == second]
    assert skipped and all(e["reason"] == "stalled" for e in skipped), skipped
    assert not [e for e in ev if e["event"] == "save" and e["tier"] == "reshardable" and e["attempt"] == second]
    final = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local" and e["attempt"] == second]
    assert final and final[-1] == 160, final

    assert stuck, "something of the job was still held by the stalled storage when the job ended"
    assert not leftovers, f"processes of the job still alive after the storage answered: {leftovers}"
