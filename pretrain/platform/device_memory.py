"""A restarted rank waits, up to a deadline, for its GPU's memory to be given back by the dead rank.

Owns the wait and its report only. A rank the kernel still holds (SIGKILL pending, a thread in D
on a stalled mount) or a forked writer it left behind keeps its CUDA context and every byte of
device memory until the process is gone; a restart onto that GPU then fails ``cudaMalloc`` while it
builds the model, and restarts in a loop. :func:`wait_for_device_memory` polls a
:class:`DeviceMemoryProbe` until the GPU's used memory falls to ``threshold_bytes`` (what this
process's own context takes, with room) or ``deadline_s`` passes, and says which (NVRx 0.7's
launcher waits the same way, 50 s for 512 MB, before it starts a worker; 0.4.1 does not wait).
It never kills anything and never fails the rank: past the deadline the caller goes on (and may
OOM), with the wait and the memory still used in the report.

Called by :func:`pretrain.train.train` after :func:`pretrain.platform.rank_device.select_rank_device`,
before any process group exists. Without CUDA there is no probe and nothing to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

# Used memory a GPU may show while no other process holds it: this process's own context (about
# 0.5 GiB on an H100 with torch's kernels loaded) and the driver's reservations.
RECLAIM_THRESHOLD_BYTES = 1 << 30


class DeviceMemoryProbe(Protocol):
    def used_bytes(self) -> int:
        """Device memory in use on this rank's GPU, by every process."""
        ...


class TorchDeviceMemory:
    """The rank's GPU as the driver reports it (``cudaMemGetInfo``: every process's use)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def used_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)


@dataclass(frozen=True)
class MemoryWait:
    freed: bool  # used memory reached the threshold before the deadline
    waited_s: float
    used_bytes: int  # at the last poll
    threshold_bytes: int

    def line(self) -> str:
        gib = 1 << 30
        if self.freed:
            return f"GPU memory free after {self.waited_s:.1f} s ({self.used_bytes / gib:.2f} GiB in use)"
        return (
            f"GPU memory still held after {self.waited_s:.1f} s: {self.used_bytes / gib:.2f} GiB in use "
            f"(at most {self.threshold_bytes / gib:.2f} GiB expected); a previous rank or its writer is still "
            "alive on this GPU; fix: find it with nvidia-smi, or exclude the node if the kernel holds it"
        )


def wait_for_device_memory(
    probe: DeviceMemoryProbe,
    deadline_s: float,
    threshold_bytes: int = RECLAIM_THRESHOLD_BYTES,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> MemoryWait:
    """Poll ``probe`` until its used memory is at most ``threshold_bytes`` or ``deadline_s`` passed."""
    start = clock()
    while True:
        used = probe.used_bytes()
        waited = clock() - start
        if used <= threshold_bytes:
            return MemoryWait(True, waited, used, threshold_bytes)
        if waited >= deadline_s:
            return MemoryWait(False, waited, used, threshold_bytes)
        sleep(min(poll_s, max(0.0, deadline_s - waited)))
