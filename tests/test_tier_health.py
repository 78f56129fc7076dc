"""The one storage-health rule of every tier (pretrain/checkpointing/tier_health.py), in one process
on a fake clock: the deadline, the start-of-attempt probe, the skip of a save, the restore's
question and a background write's verdict, answered the same on every rank. The ranks are threads
exchanging their answers through a real barrier; the storage is a switch the probes read. The
probe process and the writer's /proc progress themselves are tested on a gated FUSE mount
(tests/test_stalled_storage.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pretrain.checkpointing.tier_health import (
    STALL_FLOOR_S,
    START_PROBE_S,
    AgreedTierHealth,
    TierHealth,
    TierStalled,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Storage:
    """One rank's storage: answers or not; the probes it was asked for."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.answers = True
        self.probes: list[FakeProbe] = []

    def new_probe(self, where: Path) -> FakeProbe:
        probe = FakeProbe(self)
        self.probes.append(probe)
        return probe


class FakeProbe:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.started = storage.clock()

    def poll(self) -> bool | None:
        return True if self.storage.answers else None

    def wait(self, timeout: float) -> bool | None:
        if not self.storage.answers:
            self.storage.clock.now += timeout  # waited the whole timeout
        return self.poll()


class Progress:
    def __init__(self, idle_s: float) -> None:
        self.idle = idle_s
        self.restarts = 0

    def idle_s(self) -> float:
        return self.idle

    def restart(self) -> None:
        self.idle, self.restarts = 0.0, self.restarts + 1


class ThreadGroup:
    """A real collective among threads: each rank's object, exchanged through a barrier."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._slots: list[Any] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=10)

    def rank_view(self, rank: int) -> RankCollective:
        return RankCollective(self, rank)


class RankCollective:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def barrier(self) -> None:
        self.group._barrier.wait()

    def all_gather(self, obj: Any) -> list[Any]:
        self.group._slots[self.rank] = obj
        self.group._barrier.wait()
        out = list(self.group._slots)
        self.group._barrier.wait()
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather(obj)[src]

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather(bool(flag)))

    def min_int(self, value: int) -> int:
        return min(self.all_gather(int(value)))


Ranks = tuple[Clock, list[Storage], list[list[str]], list[AgreedTierHealth]]


def _ranks(n: int, stall_timeout_s: float | None = None, probes: Callable[[int], bool] = lambda r: True) -> Ranks:
    """``n`` ranks' agreed health on one fake clock: (clock, each rank's storage, reports, health)."""
    clock, group = Clock(), ThreadGroup(n)
    storages = [Storage(clock) for _ in range(n)]
    reports: list[list[str]] = [[] for _ in range(n)]
    agreed = []
    for rank in range(n):
        health = TierHealth(Path(f"/probe/{rank}"), 5.0, "tier 1", clock=clock, new_probe=storages[rank].new_probe)
        agreed.append(
            AgreedTierHealth(health, group.rank_view(rank), stall_timeout_s, reports[rank].append, probes(rank))
        )
    return clock, storages, reports, agreed


def _on_every_rank(agreed: list[AgreedTierHealth], ask: Callable[[AgreedTierHealth], Any]) -> list[Any]:
    """``ask`` on every rank at once (each rank a thread); every rank's answer, or the exception it raised."""
    out: list[Any] = [None] * len(agreed)

    def run(rank: int) -> None:
        try:
            out[rank] = ask(agreed[rank])
        except Exception as exc:  # the answer under test (TierStalled), compared by the caller
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(agreed))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_the_deadline_is_the_configured_value_else_ten_times_the_slowest_save_agreed_by_every_rank() -> None:
    *_, agreed = _ranks(2)
    assert [a.deadline() for a in agreed] == [STALL_FLOOR_S, STALL_FLOOR_S]
    agreed[1].saved(30.0)  # one rank's own save: its deadline alone
    assert [a.deadline() for a in agreed] == [STALL_FLOOR_S, 300.0]
    _on_every_rank(agreed, lambda a: a.agree_slowest(12.0 if a.coll.rank == 0 else 1.0))
    assert [a.deadline() for a in agreed] == [120.0, 300.0]
    *_, configured = _ranks(2, stall_timeout_s=4.0)
    configured[0].saved(100.0)
    assert configured[0].deadline() == 4.0


def test_a_probe_unanswered_at_the_start_skips_the_tier_on_every_rank_and_only_the_stalled_rank_reports() -> None:
    clock, storages, reports, agreed = _ranks(2)
    storages[1].answers = False
    t0 = clock.now
    assert _on_every_rank(agreed, lambda a: a.probe_at_start()) == [False, False]
    assert clock.now - t0 == START_PROBE_S  # min(deadline 60 s, 30 s): the setup section must not pass first
    assert reports[0] == [] and len(reports[1]) == 1 and "did not answer within 30.0s" in reports[1][0]
    assert agreed[0].healthy and not agreed[1].healthy
    notes = _on_every_rank(agreed, lambda a: a.agreed_healthy())
    assert notes[0] == notes[1] and notes[0].startswith("rank 1: stalled: a probe write of /probe/1")


def test_a_stalled_rank_skips_every_ranks_save_until_its_probe_answers() -> None:
    clock, storages, reports, agreed = _ranks(2)
    storages[0].answers = False
    assert agreed[0].stalled("stalled: the write of x did not finish within 60.0s")
    assert not agreed[0].stalled("stalled: again")  # reported once, not at every failed save
    assert reports[0] == ["stalled: the write of x did not finish within 60.0s"] and reports[1] == []
    skipped = _on_every_rank(agreed, lambda a: a.skip_if_stalled(30))
    assert all(isinstance(e, TierStalled) for e in skipped)
    assert [str(e) for e in skipped] == ["tier 1 save of step 30 skipped: rank 0: stalled: again"] * 2  # the latest why
    assert len(storages[0].probes) == 1  # one probe, started at once; none on the healthy rank
    clock.now += 4.9
    _on_every_rank(agreed, lambda a: a.agreed_healthy())
    assert len(storages[0].probes) == 1  # still the first one, unanswered: no second process
    storages[0].answers = True
    assert _on_every_rank(agreed, lambda a: a.skip_if_stalled(40)) == [None, None]
    assert agreed[0].healthy


def test_after_a_probe_fails_the_next_one_starts_only_after_the_probe_interval() -> None:
    clock, storages, _, agreed = _ranks(1)
    storages[0].answers = False
    agreed[0].stalled("stalled: x")
    storages[0].probes[0].poll = lambda: False  # the storage answered with an error: no live probe left
    assert agreed[0].agreed_healthy() is not None
    clock.now += 4.0
    assert agreed[0].agreed_healthy() is not None and len(storages[0].probes) == 1
    clock.now += 1.0
    assert agreed[0].agreed_healthy() is not None and len(storages[0].probes) == 2  # the interval (5 s) passed


def test_an_idle_writer_is_stalled_only_once_a_probe_of_its_storage_goes_unanswered_for_the_deadline() -> None:
    clock, storages, _, agreed = _ranks(2, stall_timeout_s=10.0, probes=lambda r: r == 0)
    storages[0].answers = False
    idle = [Progress(0.0), Progress(0.0)]
    watches = [a.watch(p) for a, p in zip(agreed, idle, strict=True)]
    assert _on_every_rank(agreed, lambda a: watches[a.coll.rank].verdict(False)) == [None, None]
    assert storages[0].probes == []  # no writer idle past the deadline: nothing probed
    idle[1].idle = 11.0  # rank 1's writer wrote nothing for 11 s
    assert _on_every_rank(agreed, lambda a: watches[a.coll.rank].verdict(False)) == [None, None]
    assert len(storages[0].probes) == 1  # the probing rank (one per node) asks its storage now
    assert [w.longest_idle_s for w in watches] == [11.0, 11.0]
    clock.now += 10.0
    verdicts = _on_every_rank(agreed, lambda a: watches[a.coll.rank].verdict(False))
    assert verdicts[0] == verdicts[1] and verdicts[0].startswith(
        "stalled: rank 1's writer wrote nothing for 11.0s and rank 0's probe of the storage went unanswered for 10.0s"
    )
    assert not agreed[1].stalled(verdicts[1])  # a rank that does not probe never marks itself


def test_a_writer_that_is_only_slow_on_storage_that_answers_is_never_abandoned() -> None:
    clock, storages, _, agreed = _ranks(1, stall_timeout_s=10.0)
    progress = Progress(25.0)  # one huge write: nothing counted for 25 s
    watch = agreed[0].watch(progress)
    assert watch.verdict(False) is None  # the probe starts and answers at once
    assert watch.verdict(False) is None and progress.restarts == 1 and progress.idle == 0.0
    assert watch.verdict(True) is None  # an ended writer is never idle


def test_a_writer_proc_cannot_follow_has_no_deadline() -> None:
    _, storages, _, agreed = _ranks(1, stall_timeout_s=1.0)
    storages[0].answers = False
    assert agreed[0].watch(None).verdict(False) is None and storages[0].probes == []


@pytest.mark.parametrize("probes", [True, False])
def test_every_rank_gets_the_same_answer_whether_or_not_it_probes(probes: bool) -> None:
    _, storages, reports, agreed = _ranks(2, probes=lambda r: probes or r == 0)
    storages[0].answers = False
    storages[1].answers = False
    assert _on_every_rank(agreed, lambda a: a.probe_at_start()) == [False, False]
    assert len(reports[0]) == 1 and len(reports[1]) == (1 if probes else 0)
