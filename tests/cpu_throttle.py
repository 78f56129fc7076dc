"""A slow rank from outside the job: a process put into its own cgroup with a CPU quota.

cgroup v1 (``/sys/fs/cgroup/cpu``: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) or v2 (``cpu.max``),
whichever is mounted. :func:`throttled` creates a child cgroup, moves the process (all its threads:
a write to ``cgroup.procs`` moves the thread group in v1 too) in, and in its ``finally`` moves
everything in the child back to the cgroup it came from and removes the child. Needs root (or a
delegated cgroup). Used by the straggler tests and bench (``pretrain.resilience.stragglers`` must
name the rank); the product never slows itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

V1_CPU = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # short periods spread the quota evenly over a step (100 ms would stall it in blocks)


def _cgroup_of(pid: int, v1: bool) -> str:
    """The process's cgroup path (relative to the hierarchy root) for the cpu controller."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "cpu" in controllers.split(",")) or (not v1 and controllers == ""):
            return path
    raise RuntimeError(f"/proc/{pid}/cgroup: no cpu controller line; fix: mount the cgroup cpu controller")


@contextlib.contextmanager
def throttled(pid: int, cpu_fraction: float, name: str | None = None) -> Iterator[Path]:
    """Run ``pid`` at ``cpu_fraction`` of one CPU until the block ends; yields the cgroup directory."""
    if cpu_fraction <= 0:
        raise ValueError(f"cpu_fraction must be > 0, got {cpu_fraction}")
    v1 = (V1_CPU / "cpu.cfs_quota_us").exists()
    root = V1_CPU if v1 else V2_ROOT
    home = root / _cgroup_of(pid, v1).lstrip("/")
    child = root / (name or f"pretrain-throttle-{pid}")
    child.mkdir()
    # The kernel's smallest quota is 1 ms: below 0.1 CPU the period grows instead (20 ms for 0.05).
    period = max(PERIOD_US, int(1000 / cpu_fraction))
    quota = max(int(period * cpu_fraction), 1000)
    try:
        if v1:
            (child / "cpu.cfs_period_us").write_text(str(period))
            (child / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (child / "cpu.max").write_text(f"{quota} {period}")
        (child / "cgroup.procs").write_text(str(pid))
        yield child
    finally:
        for member in (child / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                (home / "cgroup.procs").write_text(member)
        child.rmdir()


def throttled_time_us(cgroup: Path) -> int:
    """Microseconds the quota held the cgroup's processes back (v1 ``cpu.stat`` throttled_time is ns)."""
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        key, value = line.split()
        if key == "throttled_time":
            return int(value) // 1000
        if key == "throttled_usec":
            return int(value)
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuCap(threading.Thread):
    """Once ``rank_pid()`` names a process and ``step()`` has reached ``after``, measure the CPU that
    process gets for ``measure_s`` and cap it, until ``stop`` is set, at ``cap`` CPU or, without
    ``cap``, at half the measured rate. Tests give a fixed cap far below what any host gives a rank
    (it binds on a fast host too: a rank idles in every all-reduce, and a 50 % quota let its short
    forwards run at full speed there); the bench's half-speed figure uses the measured half.
    ``done`` (also written to ``record``): the step and time the cap began, the measured rate and
    the cgroup; ``error``: what went wrong, for the test."""

    def __init__(
        self,
        rank_pid: Callable[[], int | None],
        step: Callable[[], int],
        after: int,
        record: Path,
        measure_s: float = 1.0,
        cap: float | None = None,
        until: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(daemon=True)
        self.rank_pid, self.step, self.after, self.record, self.measure_s = rank_pid, step, after, record, measure_s
        self.cap = cap  # a fixed CPU cap instead of half the measured rate
        self.until = until  # the cap ends early once this is true (e.g. the rank was excluded)
        self.stop = threading.Event()
        self.done: dict[str, Any] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _run(self) -> None:
        while not self.stop.is_set():
            pid = self.rank_pid()
            if pid and self.step() >= self.after:
                break
            time.sleep(0.1)
        else:
            return
        rate: float | None = None
        cap = self.cap  # a fixed cap binds at once (a second of measuring is 25 steps of the tiny job)
        if cap is None:
            rate = self._measured_rate(pid)
            cap = max(rate / 2, 0.02)
        with throttled(pid, cap) as cgroup:
            self.done = {"step": self.step(), "time": time.time(), "rate": rate, "cgroup": str(cgroup)}
            self.record.write_text(json.dumps(self.done))
            deadline = time.monotonic() + 600
            while not self.stop.wait(0.2) and not self.until() and time.monotonic() < deadline:
                pass

    def _measured_rate(self, pid: int) -> float:
        before = cpu_seconds(pid)
        time.sleep(self.measure_s)
        return (cpu_seconds(pid) - before) / self.measure_s
