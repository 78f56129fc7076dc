"""The checkpoint manager's policy in one process, in milliseconds: which tier is due when, a save
due while one is in flight (wait or skip; the final step never skipped), the emergency save and its
deadline, a failed save (go on, or stop), and abandoning writers after a failure.

The tiers are stand-ins that keep the ``CheckpointTier`` contract (background saves finish after a
given number of polls, a save can be made to fail); the manager, its report, metrics, run log and
attempt record are the real ones. The tiers themselves are tested on real files and real ranks
elsewhere (test_publish, test_async_save, test_replication, test_preemption).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pretrain.checkpointing.manager import CheckpointManager
from pretrain.checkpointing.reporting import SaveReport
from pretrain.checkpointing.state import SaveResult
from pretrain.checkpointing.tier import CheckpointTier
from pretrain.config import FaultToleranceConfig, load_config
from pretrain.errors import PreemptedError
from pretrain.observability.metrics import TrainingMetrics
from pretrain.observability.runlog import RunLog
from pretrain.resilience.attempts import AttemptLog
from pretrain.resilience.preemption import PreemptionWatch
from pretrain.resilience.rank_monitor import RankMonitor
from tests.helpers import events
from tiering.errors import PublishError


@dataclass
class State:
    step: int = 0


class ScriptedTier:
    """A tier whose background writer is done after ``write_polls`` non-blocking polls."""

    def __init__(
        self,
        name: str,
        interval: int,
        write_polls: int = 0,
        fail_at: tuple[int, ...] = (),
        idle: bool = False,
        within_step: bool = False,
        publishes_on_thread: bool = False,
    ) -> None:
        self.name = name
        self.within_step = within_step
        self.publishes_on_thread = publishes_on_thread  # its polls only check (tier 1: a publisher thread)
        self.idle = idle  # its writer writes nothing (stalled storage): a wait that may stop, stops
        self.interval = interval
        self.write_polls = write_polls
        self.fail_at = fail_at
        self.calls: list[tuple[str, int]] = []
        self.deadlines: list[float | None] = []
        self._inflight: list[int] | None = None  # [step, polls left]

    def due(self, step: int, final: bool) -> bool:
        return final or step % self.interval == 0

    @property
    def in_flight(self) -> int | None:
        return self._inflight[0] if self._inflight is not None else None

    def busy(self) -> bool:
        return self._inflight is not None

    def prepare(self) -> None:
        self.calls.append(("prepare", 0))

    def save(self, state: State, deadline: float | None = None) -> SaveResult:  # type: ignore[override]
        self.calls.append(("save", state.step))
        self.deadlines.append(deadline)
        return self._published(state.step)

    def start_async(self, state: State) -> float:  # type: ignore[override]
        assert self._inflight is None, "one save in flight at most"
        self.calls.append(("start", state.step))
        self._inflight = [state.step, self.write_polls]
        return 0.0

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        if self._inflight is None:
            return None
        step, left = self._inflight
        if block and stop_when_idle and self.idle:
            self.calls.append(("stopped waiting", step))
            return None
        if not block and left > 0:
            self._inflight[1] -= 1
            return None
        self._inflight = None
        self.calls.append(("blocking publish" if block and left > 0 else "publish", step))
        return self._published(step)

    def poll_fits_in_step(self) -> bool:
        """Only checks, unless the next poll publishes on the training thread (the reshardable tier)."""
        return self.publishes_on_thread or self._inflight is None or self._inflight[1] > 0

    def abandon_async(self) -> None:
        self.calls.append(("abandon", self.in_flight or 0))
        self._inflight = None

    def _published(self, step: int) -> SaveResult:
        if step in self.fail_at:
            raise PublishError(f"step {step}: rank 1: disk full: 10 bytes free; fix: more space")
        return SaveResult(self.name, step, 0.01, 1000, Path(f"/steps/{step}"))


@dataclass
class Tiers:
    """The ``TierSet`` of two stand-in tiers (tier 1 first), with the trainer's final step."""

    local: ScriptedTier | None
    staging: ScriptedTier | None
    steps: int
    committed_steps: list[int] = field(default_factory=list)
    memory: ScriptedTier | None = None
    stall_s: float = 5.0  # the tiers' longest stall deadline

    @property
    def tier1(self) -> ScriptedTier | None:
        return self.local

    def prepare(self) -> None:
        for tier in self.background_tiers():
            tier.prepare()

    def restore(self, state: State) -> None:  # type: ignore[override]
        return None

    def due(self, step: int) -> list[CheckpointTier]:
        return [t for t in self.background_tiers() if t.due(step, step == self.steps)]

    def background_tiers(self) -> list[CheckpointTier]:
        return [t for t in (self.memory, self.local, self.staging) if t is not None]

    def before_optimizer_step(self) -> float:
        return 0.0

    def in_flight_count(self) -> int:
        return sum(t.in_flight is not None for t in self.background_tiers())

    def stall_deadline_s(self) -> float:
        return self.stall_s

    def committed(self, step: int) -> None:
        self.committed_steps.append(step)


class SectionLog(RankMonitor):
    """The rank monitor without a launcher, recording the sections opened and ended, in order."""

    def __init__(self, cfg: FaultToleranceConfig) -> None:
        super().__init__(cfg)
        self.calls: list[tuple[str, str]] = []

    def start(self, section: str) -> None:
        self.calls.append(("start", section))

    def end(self, section: str) -> None:
        self.calls.append(("end", section))


class BeatLog(RankMonitor):
    """The rank monitor without a launcher, recording each heartbeat into ``calls`` (a tier's)."""

    calls: list[tuple[str, int]]

    def beat(self) -> None:
        self.calls.append(("beat", 0))


def _manager(
    tmp: Path,
    tiers: Tiers,
    *settings: str,
    monitor: type[RankMonitor] = RankMonitor,
    sync_weights: Callable[[], None] | None = None,
) -> tuple[CheckpointManager, State, PreemptionWatch]:
    cfg = load_config(None, [f"train.steps={tiers.steps}", "fault_tolerance.enabled=false", *settings])
    records = AttemptLog(tmp, enabled=True)
    records.begin("attempt-00-t", 1, ["node"], {})
    runlog = RunLog(str(tmp), "t", "attempt-00-t", enabled=True)
    report = SaveReport(tiers, runlog, TrainingMetrics("t"), records, 0, cfg.checkpoint.on_save_error == "stop")
    watch = PreemptionWatch([signal.SIGUSR2], timeout_s=5.0, on_deadline=lambda name: None)
    state = State()
    manager = CheckpointManager(
        cfg,
        tiers,
        state,
        report,
        monitor(cfg.fault_tolerance),
        watch,
        sync_weights=sync_weights,  # type: ignore[arg-type]
    )
    return manager, state, watch


def _train(manager: CheckpointManager, state: State, steps: range) -> None:
    for step in steps:
        state.step = step
        manager.after_step(step, leaving=False)


def _events(tmp: Path, kind: str) -> list[dict[str, object]]:
    return [r for r in events(tmp / "t") if r["event"] == kind]


@pytest.mark.parametrize("background", [False, True])
def test_each_tier_saves_at_its_interval_and_at_the_final_step(tmp_path: Path, background: bool) -> None:
    tiers = Tiers(ScriptedTier("local", 10), ScriptedTier("reshardable", 25), steps=60)
    manager, state, _ = _manager(tmp_path, tiers, f"checkpoint.async.enabled={background}")
    _train(manager, state, range(1, 61))
    manager.finish()
    verb = "publish" if background else "save"
    assert [s for c, s in tiers.local.calls if c == verb] == [10, 20, 30, 40, 50, 60]
    assert [s for c, s in tiers.staging.calls if c == verb] == [25, 50, 60]
    assert sorted(tiers.committed_steps) == sorted([10, 20, 30, 40, 50, 60, 25, 50, 60])


def test_a_save_due_while_one_is_in_flight_is_skipped_but_never_the_final_one(tmp_path: Path) -> None:
    # Each tier-1 write takes 12 polls (steps) to finish: the save due 10 steps later finds it busy.
    tiers = Tiers(ScriptedTier("local", 10, write_polls=12), None, steps=30)
    manager, state, _ = _manager(tmp_path, tiers, "checkpoint.async.when_busy=skip")
    _train(manager, state, range(1, 31))
    manager.finish()
    assert [s for c, s in tiers.local.calls if c == "start"] == [10, 30]
    assert [(e["step"], e["in_flight"]) for e in _events(tmp_path, "save_skipped")] == [(20, 10)]
    # The final step found step 10's write done by then (12 polls): it started, and finish() polled
    # it until it was published.
    assert tiers.local.calls[-1] == ("publish", 30) and 30 in tiers.committed_steps


def test_a_save_due_while_one_is_in_flight_waits_for_it_by_default(tmp_path: Path) -> None:
    tiers = Tiers(ScriptedTier("local", 10, write_polls=15), None, steps=20)
    manager, state, _ = _manager(tmp_path, tiers)
    _train(manager, state, range(1, 21))
    manager.finish()
    assert tiers.local.calls[0:3] == [("start", 10), ("blocking publish", 10), ("start", 20)]
    assert not _events(tmp_path, "save_skipped")


@pytest.mark.parametrize("stall_s", [5.0, 0.15])
def test_finish_polls_the_final_save_with_a_heartbeat_after_each_poll_up_to_the_stall_deadline(
    tmp_path: Path, stall_s: float
) -> None:
    """The final saves are waited for as a step waits for a save in flight: one non-blocking poll,
    then a heartbeat (a heartbeat timeout shorter than the save must not kill a rank that is
    saving); past the tiers' longest stall deadline, what is left is waited for without them."""
    writes = 3 if stall_s == 5.0 else 4  # the write ends after that many non-blocking polls
    tiers = Tiers(ScriptedTier("local", 10, write_polls=writes), None, steps=10, stall_s=stall_s)
    manager, state, _ = _manager(tmp_path, tiers, monitor=BeatLog)
    manager.monitor.calls = tiers.local.calls  # type: ignore[attr-defined]
    _train(manager, state, range(1, 11))
    manager.finish()
    if stall_s == 5.0:  # the step's own poll, two more polls and heartbeats, then the publish and its heartbeat
        assert tiers.local.calls == [("start", 10), ("beat", 0), ("beat", 0), ("publish", 10), ("beat", 0)]
    else:  # rounds of 0.1 s: two polls with their heartbeats, then one blocking wait
        assert tiers.local.calls == [("start", 10), ("beat", 0), ("beat", 0), ("blocking publish", 10)]
    assert tiers.committed_steps == [10]


def test_a_save_due_while_one_stopped_writing_is_skipped_but_the_final_one_waits(tmp_path: Path) -> None:
    """Waiting on a save whose storage stalled could outlast the checkpointing section (the rank
    killed): the tier says when it suspects a stall, and the save due then is skipped."""
    tiers = Tiers(ScriptedTier("local", 10, write_polls=100, idle=True), None, steps=30)
    manager, state, _ = _manager(tmp_path, tiers)
    _train(manager, state, range(1, 31))
    assert tiers.local.calls == [("start", 10), ("stopped waiting", 10), ("blocking publish", 10), ("start", 30)]
    assert [(e["step"], e["in_flight"]) for e in _events(tmp_path, "save_skipped")] == [(20, 10)]


def test_a_snapshot_that_fits_in_a_step_is_judged_by_the_step_timeout_any_other_save_by_checkpointing(
    tmp_path: Path,
) -> None:
    """Tier 0 every step must not put part of every step in the checkpointing section (sized for
    the slowest save): a rank that hangs there would be found only after that long. Nor must a
    tier-1 save in flight, whose poll is a status exchange, nor a reshardable one while its writers
    run. A save due of another tier, the poll that publishes a reshardable save on the training
    thread (step 17) and the final step are checkpointing."""
    memory = ScriptedTier("memory", 1, within_step=True, publishes_on_thread=True)
    local = ScriptedTier("local", 10, write_polls=2, publishes_on_thread=True)
    tiers = Tiers(local, ScriptedTier("reshardable", 15, write_polls=2), steps=30, memory=memory)
    manager, state, _ = _manager(tmp_path, tiers, monitor=SectionLog)
    sections: dict[int, list[tuple[str, str]]] = {}
    for step in range(1, 31):
        state.step = step
        manager.monitor.calls.clear()  # type: ignore[attr-defined]
        manager.after_step(step, leaving=False)
        sections[step] = list(manager.monitor.calls)  # type: ignore[attr-defined]
    in_step = [("end", "checkpointing"), ("end", "step")]  # ending a section not open is a no-op
    in_checkpointing = [("end", "step"), ("start", "checkpointing"), *in_step]
    assert {s for s, calls in sections.items() if calls == in_checkpointing} == {10, 15, 17, 20, 30}
    assert all(calls == in_step for s, calls in sections.items() if s not in (10, 15, 17, 20, 30))
    assert [s for c, s in memory.calls if c == "start"] == list(range(1, 31))
    assert [s for c, s in local.calls if c == "publish"] == [10, 20]  # 30: published by finish()


def test_a_preemption_publishes_an_emergency_tier1_step_within_the_deadline_and_leaves(tmp_path: Path) -> None:
    tiers = Tiers(ScriptedTier("local", 10), ScriptedTier("reshardable", 50), steps=100)
    manager, state, watch = _manager(tmp_path, tiers)
    _train(manager, state, range(1, 14))
    signal.raise_signal(signal.SIGUSR2)
    assert watch.requested and watch.deadline is not None and watch.deadline > time.monotonic()
    state.step = 14
    with pytest.raises(PreemptedError) as left:
        manager.after_step(14, leaving=True)
    assert tiers.local.calls[-1] == ("save", 14) and tiers.local.deadlines[-1] == watch.deadline
    assert "emergency save of step 14 published" in left.value.message
    (event,) = _events(tmp_path, "preempted")
    assert event["published"] is True and event["step"] == 14


@pytest.mark.parametrize("background", [False, True])
def test_the_weights_are_synced_before_every_snapshot_and_at_no_other_step(tmp_path: Path, background: bool) -> None:
    """Issue 45 #16: with the parameter all-gather overlapped (CUDA), the manager forces the pending
    gather once before the tiers due at a step snapshot (tier 0 every 3rd step here, tier 1 every
    4th, the reshardable tier every 10th) and before the emergency save; a step without a save due
    gathers nothing (the next forward's pre-hooks do, overlapped)."""
    order: list[tuple[str, int]] = []
    memory = ScriptedTier("memory", 3, within_step=True)
    local, staging = ScriptedTier("local", 4), ScriptedTier("reshardable", 10)
    memory.calls = local.calls = staging.calls = order  # one record, in the order things happened
    tiers = Tiers(local, staging, steps=100, memory=memory)
    state_box: list[State] = []
    manager, state, watch = _manager(
        tmp_path,
        tiers,
        f"checkpoint.async.enabled={background}",
        sync_weights=lambda: order.append(("sync", state_box[0].step)),
    )
    state_box.append(state)
    _train(manager, state, range(1, 22))
    snapshots = [(c, s) for c, s in order if c in ("save", "start")]
    due = sorted({s for _, s in snapshots})
    assert due == [3, 4, 6, 8, 9, 10, 12, 15, 16, 18, 20, 21]
    assert [s for c, s in order if c == "sync"] == due  # once per step with a save due, never otherwise
    for step in due:
        first = next(i for i, (c, s) in enumerate(order) if s == step and c in ("save", "start"))
        assert order[first - 1] == ("sync", step), order
    signal.raise_signal(signal.SIGUSR2)
    assert watch.requested
    state.step = 22  # no tier due: only the emergency tier-1 save snapshots, after a sync
    with pytest.raises(PreemptedError):
        manager.after_step(22, leaving=True)
    assert order[-2:] == [("sync", 22), ("save", 22)]


def test_an_emergency_save_that_fails_leaves_without_a_step_and_says_so(tmp_path: Path) -> None:
    tiers = Tiers(ScriptedTier("local", 10, fail_at=(7,)), None, steps=100)
    manager, state, watch = _manager(tmp_path, tiers)
    signal.raise_signal(signal.SIGUSR2)
    state.step = 7
    with pytest.raises(PreemptedError) as left:
        manager.after_step(7, leaving=True)
    assert "emergency save of step 7 not published" in left.value.message and "disk full" in left.value.message
    (event,) = _events(tmp_path, "preempted")
    assert event["published"] is False


def test_leaving_right_after_a_tier1_save_publishes_that_step_instead_of_saving_again(tmp_path: Path) -> None:
    tiers = Tiers(ScriptedTier("local", 10, write_polls=5), None, steps=100)
    manager, state, watch = _manager(tmp_path, tiers)
    _train(manager, state, range(1, 10))
    signal.raise_signal(signal.SIGUSR2)
    state.step = 10
    with pytest.raises(PreemptedError) as left:
        manager.after_step(10, leaving=True)
    assert tiers.local.calls[-2:] == [("start", 10), ("blocking publish", 10)]
    assert "step 10 was just saved in tier 1" in left.value.message


@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_a_failed_save_is_reported_and_training_goes_on_unless_told_to_stop(tmp_path: Path, on_error: str) -> None:
    tiers = Tiers(ScriptedTier("local", 10, fail_at=(20,)), None, steps=40)
    manager, state, _ = _manager(tmp_path, tiers, f"checkpoint.on_save_error={on_error}")
    if on_error == "stop":
        with pytest.raises(PublishError, match="disk full"):
            _train(manager, state, range(1, 41))
        assert state.step == 20
        return
    _train(manager, state, range(1, 41))
    manager.finish()
    assert tiers.committed_steps == [10, 30, 40]
    (failed,) = _events(tmp_path, "save_failed")
    assert failed["step"] == 20 and failed["reason"] == "disk_full"


def test_abandon_stops_every_background_writer(tmp_path: Path) -> None:
    tiers = Tiers(ScriptedTier("local", 10, write_polls=99), ScriptedTier("reshardable", 10, write_polls=99), 50)
    manager, state, _ = _manager(tmp_path, tiers)
    _train(manager, state, range(1, 11))
    assert tiers.in_flight_count() == 2
    manager.abandon()
    assert tiers.in_flight_count() == 0
    assert ("abandon", 10) in tiers.local.calls and ("abandon", 10) in tiers.staging.calls
    assert 10 not in tiers.committed_steps
