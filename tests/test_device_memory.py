"""A restarted rank waits for the dead rank's GPU memory with a deadline and says what it found
(issue 45 #3). The GPU is the one thing here that cannot run for real: the probe is the seam, a
script of readings a dying process would give; the clock is a counter the waits advance."""

from __future__ import annotations

import pytest

from pretrain.platform.device_memory import RECLAIM_THRESHOLD_BYTES, MemoryWait, wait_for_device_memory

GIB = 1 << 30


class Readings:
    """Used bytes, one reading per poll; the last one repeats (a process the kernel keeps)."""

    def __init__(self, *gib: float) -> None:
        self.left = [int(g * GIB) for g in gib]
        self.polls = 0

    def used_bytes(self) -> int:
        self.polls += 1
        return self.left.pop(0) if len(self.left) > 1 else self.left[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _wait(readings: Readings, deadline_s: float, clock: Clock) -> MemoryWait:
    return wait_for_device_memory(readings, deadline_s, poll_s=0.5, clock=clock, sleep=clock.sleep)


def test_a_free_gpu_is_not_waited_for() -> None:
    clock, readings = Clock(), Readings(0.6)
    wait = _wait(readings, 50.0, clock)
    assert wait == MemoryWait(True, 0.0, int(0.6 * GIB), RECLAIM_THRESHOLD_BYTES)
    assert readings.polls == 1 and clock.sleeps == []


def test_memory_given_back_while_waiting_ends_the_wait_at_that_poll() -> None:
    clock, readings = Clock(), Readings(70, 70, 70, 12, 0.4)
    wait = _wait(readings, 50.0, clock)
    assert wait.freed and wait.waited_s == pytest.approx(2.0) and wait.used_bytes == int(0.4 * GIB)
    assert readings.polls == 5
    assert wait.line() == "GPU memory free after 2.0 s (0.40 GiB in use)"


def test_memory_still_held_at_the_deadline_is_reported_with_the_sizes_and_a_fix() -> None:
    clock, readings = Clock(), Readings(70)
    wait = _wait(readings, 3.2, clock)
    assert not wait.freed and wait.waited_s == pytest.approx(3.2) and wait.used_bytes == 70 * GIB
    assert sum(clock.sleeps) == pytest.approx(3.2) and max(clock.sleeps) <= 0.5  # never past the deadline
    line = wait.line()
    assert line.startswith("GPU memory still held after 3.2 s: 70.00 GiB in use (at most 1.00 GiB expected)")
    assert "fix:" in line and "\n" not in line


def test_a_zero_deadline_polls_once() -> None:
    clock, readings = Clock(), Readings(70)
    wait = _wait(readings, 0.0, clock)
    assert not wait.freed and readings.polls == 1 and clock.sleeps == []
