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
from collections.abc import Iterator
from pathlib import Path

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
    quota = max(int(PERIOD_US * cpu_fraction), 1000)
    try:
        if v1:
            (child / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (child / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (child / "cpu.max").write_text(f"{quota} {PERIOD_US}")
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
