"""The memory state each run of a pair starts in, on a VM that hands freed memory back to its host.

With free page reporting (virtio-balloon's ``VIRTIO_BALLOON_F_REPORTING``), the guest reports free
2 MiB blocks to the host a couple of seconds after they are freed and the host takes them back;
the next first touch of such a page faults into the host. Measured on the bench VM (README
"Measured"): writing 2 GB into new page-cache pages took 0.35 s when the memory had been freed
under half a second before, 2-3.5 s after 1-5 s and 4.4-5.3 s once all of it was taken back (2 GB
freed: ~6 s; 4 GB: ~10 s), whatever the number of writing threads. A 2 GB run lasts about as long
as that delay, so whether the pages it lands in are still the guest's was a race decided by what
the run before it freed and when: the same path was 1.0 s or 2.1 s from one repeat to the next,
and a path that ran after one that freed more memory looked faster.

So a pair whose runs land bytes in new memory starts every run from the same state: what the run
before left is removed first, then the bench waits until the host can have taken it back. That is
the state of a node restarting after a failure (its memory idle), and the slow one: every such
path pays the host's price in full, the product and its raw baseline alike. Without free page
reporting (bare metal; GPU VMs, whose guest memory is pinned for device passthrough) nothing waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tiering.system.fsio import dir_size

VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
REPORTING_FEATURE_BIT = 5  # VIRTIO_BALLOON_F_REPORTING (virtio spec 5.5.3)
RECLAIM_DELAY_S = 2.0  # the kernel's page reporting delay before it reports a freed block
RECLAIM_S_PER_GB = 2.0  # measured here: 2 GB freed were all taken back after ~6 s, 4 GB after ~10 s


def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio balloon on this machine reports free pages to its host."""
    if not devices.is_dir():
        return False
    for dev in devices.iterdir():
        driver = dev / "driver"
        if not driver.exists() or driver.resolve().name != "virtio_balloon":
            continue
        try:
            features = (dev / "features").read_text().strip()
        except OSError:
            continue
        if len(features) > REPORTING_FEATURE_BIT and features[REPORTING_FEATURE_BIT] == "1":
            return True
    return False


def reclaim_wait_s(freed_bytes: int, reporting: bool) -> float:
    """Seconds after freeing ``freed_bytes`` until the host can have taken all of them back."""
    if not reporting or freed_bytes <= 0:
        return 0.0
    return RECLAIM_DELAY_S + RECLAIM_S_PER_GB * freed_bytes / 1e9


def tree_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the regular files under ``paths`` (files or directories; missing ones count 0)."""
    total = 0
    for path in paths:
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += dir_size(path)
    return total


class ReclaimedStart:
    """A ``settle`` step for :func:`bench.pairs.alternate`: ``clear()`` frees what the run before
    left (it returns the bytes it freed), the writeback is flushed, and the bench waits until the
    host can have taken the freed memory back. ``waited_s`` keeps the total, for the report."""

    def __init__(self, clear: Callable[[], int], reporting: bool | None = None) -> None:
        self.clear = clear
        self.reporting = free_page_reporting() if reporting is None else reporting
        self.waited_s = 0.0

    def __call__(self) -> None:
        freed = self.clear()
        os.sync()
        wait = reclaim_wait_s(freed, self.reporting)
        time.sleep(wait)
        self.waited_s += wait
