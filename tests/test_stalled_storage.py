"""A stalled tier-1 file system never wedges the job (issue 30 part 5), in one process.

Tier 1 lives on a real FUSE mount (``pretrain/soak/gated_fs.py``) whose data writes block in the kernel
while its gate is closed, as a hung NFS/Lustre server's do. ``PerRankCheckpoints`` is built as a
job builds it, on ``SingleProcess`` (see tests/test_restore_selection.py). Every mount is unmounted
and its gate opened (freeing every blocked writer) by the fixture, even when a test fails. The
end-to-end proof under ft_launcher is tests/test_stalled_storage_job.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pretrain.checkpointing.per_rank import PerRankCheckpoints
from pretrain.checkpointing.reporting import failure_reason
from pretrain.checkpointing.tier_health import (
    STALL_FLOOR_S,
    TierHealth,
    TierStalled,
    WriteProgress,
    stall_deadline,
    written_bytes,
)
from pretrain.config import Config
from tests.helpers import REPO
from tests.test_restore_selection import _cfg, _save, _state, _tiers, _train_to
from tiering.errors import PublishError

fuse = pytest.importorskip("fuse", reason="fusepy missing: pip install -e '.[test]'")

from pretrain.soak.storage import GatedMount  # noqa: E402

DEADLINE_S = 1.5


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[GatedMount]:
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root to mount a FUSE file system")
    mount = GatedMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "gate", tmp_path / "fuse.log")
    try:
        yield mount
    finally:
        mount.stop()


def _stalling_cfg(tmp: Path, mount: GatedMount, *settings: str) -> Config:
    return _cfg(
        tmp,
        f"checkpoint.local.dir={mount.mountpoint}",
        f"checkpoint.local.stall_timeout_s={DEADLINE_S}",
        "checkpoint.local.probe_interval_s=0.2",
        *settings,
    )


def _poll_until_done(tiers: PerRankCheckpoints, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    while tiers.poll_async() is None:
        assert time.monotonic() < end, "the save neither finished nor stalled in time"
        time.sleep(0.05)


def _wait_usable(tiers: PerRankCheckpoints, limit_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while tiers.storage.agreed_healthy() is not None:
        assert time.monotonic() - t0 < limit_s, "the tier never came back after the storage answered"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.parametrize(
    ("configured", "slowest", "expected"),
    [(None, 0.0, STALL_FLOOR_S), (None, 2.0, STALL_FLOOR_S), (None, 30.0, 300.0), (5.0, 30.0, 5.0)],
)
def test_the_stall_deadline_is_the_configured_value_or_ten_times_the_slowest_save_with_a_floor(
    configured: float | None, slowest: float, expected: float
) -> None:
    assert stall_deadline(configured, slowest) == expected


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (PublishError("step 20 is not complete in tier 1: rank 1: stalled: the write of x did not finish"), "stalled"),
        (TierStalled("tier 1 save of step 30 skipped: ..."), "stalled"),
        (PublishError("psutil is not installed"), "error"),  # 'installed' is no stall
        (PublishError("No space left on device: stalled?"), "disk_full"),
        (
            PublishError("step 10 is not complete in tier 1: rank 0: checkpoint agent a: no answer (TimeoutError)"),
            "agent_gone",
        ),
    ],
)
def test_a_stall_has_its_own_failure_reason(error: Exception, reason: str) -> None:
    assert failure_reason(error) == reason


@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_a_write_that_never_returns_marks_the_tier_stalled_and_saves_resume_once_the_storage_answers(
    tmp_path: Path, gated: GatedMount, mode: str
) -> None:
    cfg = _stalling_cfg(tmp_path, gated, f"checkpoint.async.mode={mode}")
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    gated.close()
    _train_to(state, 20)
    t0 = time.monotonic()
    tiers.start_async(state)
    with pytest.raises(PublishError, match=r"stalled: the write of .*state.pt did not finish within 1.5s"):
        _poll_until_done(tiers, 10 * DEADLINE_S)
    stalled_after = time.monotonic() - t0
    assert DEADLINE_S <= stalled_after < DEADLINE_S + 2.0
    assert not tiers.storage.healthy and tiers.in_flight is None and not tiers.busy()
    _train_to(state, 30)
    with pytest.raises(TierStalled, match="tier 1 save of step 30 skipped: rank 0: stalled"):
        tiers.start_async(state)  # skipped at once: nothing is written while the storage stalls
    assert tiers.storage.agreed_healthy() is not None  # a probe runs in its own process; the gate is still closed
    gated.open()
    assert _wait_usable(tiers) < 2.0
    _train_to(state, 40)
    tiers.start_async(state)
    _poll_until_done(tiers, 30)
    assert tiers.store.committed_steps() == [40, 10]


def test_a_blocking_poll_gives_up_at_the_deadline(tmp_path: Path, gated: GatedMount) -> None:
    cfg = _stalling_cfg(tmp_path, gated, "checkpoint.async.mode=fork")
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    gated.close()
    _train_to(state, 20)
    tiers.start_async(state)
    t0 = time.monotonic()
    with pytest.raises(PublishError, match="stalled"):
        tiers.poll_async(block=True)  # the final step's wait, or when_busy=wait
    assert time.monotonic() - t0 < DEADLINE_S + 2.0


def test_a_synchronous_save_on_a_stalled_storage_fails_at_the_deadline_and_the_next_is_skipped(
    tmp_path: Path, gated: GatedMount
) -> None:
    """The emergency save on preemption and checkpoint.async.enabled: false: the training thread
    waits at most the deadline, never in the kernel (the write is a writer process on CPU)."""
    cfg = _stalling_cfg(tmp_path, gated)
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    gated.close()
    _train_to(state, 20)
    t0 = time.monotonic()
    with pytest.raises(PublishError, match="step 20 is not complete in tier 1: rank 0: stalled: the write of"):
        tiers.save(state)
    assert DEADLINE_S <= time.monotonic() - t0 < DEADLINE_S + 2.0
    _train_to(state, 30)
    with pytest.raises(TierStalled):
        tiers.save(state, deadline=time.monotonic() + 30)
    gated.open()
    _wait_usable(tiers)
    _save(tiers, state, 40)
    assert tiers.store.committed_steps() == [40, 10]


def test_auto_writes_tier_1_from_its_own_process_on_cpu(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)  # checkpoint.async.mode: auto
    tiers, state = _tiers(cfg), _state(cfg)
    _train_to(state, 10)
    tiers.start_async(state)
    assert tiers._inflight is not None and tiers._inflight["write"].pid is not None  # a writer process
    _poll_until_done(tiers, 30)
    assert tiers.store.committed_steps() == [10]


def test_a_restore_never_waits_on_a_stalled_tier(tmp_path: Path, gated: GatedMount) -> None:
    cfg = _stalling_cfg(tmp_path, gated)
    tiers, state = _tiers(cfg), _state(cfg)
    _save(tiers, state, 10)
    gated.close()
    t0 = time.monotonic()
    after = _tiers(cfg, "a1")  # its prepare() probes the storage in a process it does not wait for
    plan = after.plan_restore()
    assert time.monotonic() - t0 < DEADLINE_S + 2.0
    assert plan.restore is None and "tiers 1-2 skipped: rank 0: stalled: a probe write" in plan.rejected[0]
    assert not after.storage.healthy
    gated.open()
    assert _wait_usable(after) < 2.0
    assert _tiers(cfg, "a2").plan_restore().restore.step == 10


def test_the_health_probe_marks_a_stalled_tier_healthy_only_when_the_storage_answers(
    tmp_path: Path, gated: GatedMount
) -> None:
    health = TierHealth(gated.mountpoint / ".health", probe_interval_s=0.1)
    assert health.check_now(5.0) and health.healthy
    gated.close()
    assert not health.check_now(0.5) and health.reason is not None and "did not answer" in health.reason
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert not health.usable()
        time.sleep(0.05)
    gated.open()
    deadline = time.monotonic() + 5.0
    while not health.usable():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert health.healthy and health.reason is None


# A writer as Megatron's is: a process whose child does the writing, 4 KB every 20 ms.
_WRITER_TREE = """
import os, sys, time
if os.fork() == 0:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
    while True:
        os.write(fd, b"x" * 4096)
        time.sleep(0.02)
os.wait()
"""


def _idle_after(progress: WriteProgress, seconds: float) -> float:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        idle = progress.idle_s()
        time.sleep(0.05)
    return idle


def test_write_progress_counts_what_a_writers_children_write_and_stops_at_a_stalled_write(
    tmp_path: Path, gated: GatedMount
) -> None:
    """The reshardable tier's stall deadline counts from the writer's last written byte: a
    write that moves is never a stall, one stuck in the kernel is, read without touching the mount."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER_TREE, str(gated.mountpoint / "shard.distcp")])
    try:
        progress = WriteProgress(proc.pid)
        assert _idle_after(progress, 1.0) < 0.8, "the child's writes are the writer's progress"
        gated.close(only=(".distcp",))
        assert _idle_after(progress, 2.5) > 1.5, "a write stuck in the kernel is no progress"
        small = gated.mountpoint / "common.pt"  # files not named in the gate still answer
        subprocess.run([sys.executable, "-c", f"open({str(small)!r}, 'wb').write(b'y')"], timeout=10, check=True)
        gated.open()
        assert _idle_after(progress, 1.0) < 0.8
    finally:
        gated.open()
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait(10)
    assert written_bytes(proc.pid) is None, "a process that is gone has written nothing more"


def _state_of(pid: int) -> str | None:
    """The process's state letter (R, S, D, Z, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _wait_blocked(proc: subprocess.Popen[str], for_s: float, within_s: float) -> None:
    """Return once ``proc`` has stayed blocked (state Z, D or S) for ``for_s`` in a row; fail if it
    exits, or is not blocked so long within ``within_s``."""
    deadline = time.monotonic() + within_s
    since = None
    while True:
        assert proc.poll() is None, f"exited ({proc.returncode}) while its writer is stuck in the kernel"
        now = time.monotonic()
        if _state_of(proc.pid) in ("Z", "D", "S"):
            since = now if since is None else since
            if now - since >= for_s:
                return
        else:
            since = None
        assert now < deadline, f"returned from main, but not blocked: state {_state_of(proc.pid)}"
        time.sleep(0.05)


def _run_stuck_writer(tmp: Path, mount: GatedMount, mode: str) -> tuple[subprocess.Popen[str], int]:
    """Start tests/stuck_writer.py (it closes the gate); returns it once it reported the stall."""
    cmd = [sys.executable, "-m", "tests.stuck_writer", str(tmp / mode), str(mount.mountpoint), mode, str(mount.gate)]
    cmd.append(str(mount.log))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith(("stalled", "never", "published")):  # never stalled, never held
        line = proc.stdout.readline()  # warnings and log lines before the verdict
    assert line.startswith("stalled"), line
    return proc, int(line.split()[1])


def test_a_rank_exits_while_its_fork_writer_is_stuck_in_the_kernel(tmp_path: Path, gated: GatedMount) -> None:
    """The writer is its own process: the rank leaves at once; the writer, unkillable in the
    kernel meanwhile, exits when the storage answers."""
    mount = gated
    proc, writer = _run_stuck_writer(tmp_path, mount, "fork")
    try:
        # The gate stays closed until after this: any exit proves the rank was not held. 10 s was
        # passed by the interpreter's own teardown at load 20+ on 2 cores.
        assert proc.wait(timeout=30) == 0
        assert writer > 0 and _state_of(writer) == "D", "the orphaned writer is stuck in the kernel"
    finally:
        proc.kill()
        mount.open()
    deadline = time.monotonic() + 10
    while _state_of(writer) not in (None, "Z"):
        assert time.monotonic() < deadline, "the writer did not exit once the storage answered"
        time.sleep(0.05)


def test_a_thread_writer_stuck_in_the_kernel_keeps_the_process_from_exiting(tmp_path: Path, gated: GatedMount) -> None:
    """Why auto is fork on CPU: with the write in a thread the process cannot finish exiting
    (ft_launcher would wait for it) until the storage answers."""
    mount = gated
    proc, _ = _run_stuck_writer(tmp_path, mount, "thread")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
        # Returned from main, but not gone: blocked (waiting for its writer thread, or a zombie
        # leader beside it), not merely slow to tear down on a loaded machine, where it may still
        # be running its exit a while. Blocked for a second in a row, and alive all along.
        _wait_blocked(proc, for_s=1.0, within_s=60)
        mount.open()
        assert proc.wait(timeout=10) == 0  # gone as soon as the write returned
    finally:
        mount.open()
        proc.kill()
        proc.wait(10)
