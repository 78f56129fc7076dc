"""Whether tier 1's storage answers: the deadline of its saves, the tier marked unhealthy when one
passes, and the probe that marks it healthy again. Nothing here can block the training thread.

A stalled file system (an NFS or Lustre server that stopped answering, a FUSE daemon that hangs)
does not fail a write: the write waits in the kernel, uninterruptibly, for as long as the storage
stalls, and a process with a thread stuck there cannot even finish exiting. So:

* :func:`stall_deadline`: the seconds a tier-1 save (write, commit, replication) may take before
  its tier counts as stalled: ``checkpoint.local.stall_timeout_s`` when set, else
  ``max(STALL_FLOOR_S, STALL_FACTOR x the slowest tier-1 save of this attempt)``.
* :class:`StorageProbe`: a small write, fsync, rename and delete under the tier's directory, done
  by a spawned process (a fresh interpreter without torch: it never forks a CUDA process). The
  rank waits for it at most a deadline and never joins it: a probe stuck in the kernel stays
  behind as its own process, which exits when the storage answers, never as a thread of the rank.
* :class:`TierHealth`: healthy, or unhealthy since when and why. :meth:`TierHealth.usable` is
  non-blocking: a probe starts the moment the tier turns unhealthy (a stuck one answers as soon
  as the storage does), then at most every ``probe_interval_s`` after one that failed; reading
  the last one's exit is all it does, and an answer makes the tier healthy again.

The caller (:class:`pretrain.checkpointing.per_rank.PerRankCheckpoints`) decides what a stall
means for the job: it abandons the stuck writer, skips the tier's saves and restores while any
rank's tier is unhealthy, and reports it (log line, metric, alert).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tiering.errors import PublishError

log = logging.getLogger(__name__)

STALL_FLOOR_S = 60.0  # no deadline below this unless configured: a busy NVMe can take seconds
STALL_FACTOR = 10.0  # x the slowest save seen: a 10x slowdown is a stall, not a slow disk
STALLED = "stalled"  # how a stalled save's message starts (and its failure reason)
DISK_FULL = "disk_full"  # the reason of a save (or of the room made for one) that found its volume full

# What the probe process runs: the calls a save makes (create, write, fsync, rename, delete).
_PROBE = """
import os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
p = os.path.join(d, f".probe-{os.getpid()}")
fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.write(fd, b"x" * 4096)
os.fsync(fd)
os.close(fd)
os.replace(p, p + ".done")
os.unlink(p + ".done")
"""


def stall_deadline(configured: float | None, slowest_save_s: float) -> float:
    """Seconds a tier-1 save may take before its storage counts as stalled."""
    if configured is not None:
        return configured
    return max(STALL_FLOOR_S, STALL_FACTOR * slowest_save_s)


class StorageProbe:
    """One probe of a directory, in its own process (see the module docstring)."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.started = time.monotonic()
        cmd = [sys.executable, "-I", "-S", "-c", _PROBE, str(where)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> bool | None:
        """None while it runs; True once the storage answered, False if it answered with an error."""
        code = self._proc.poll()
        if code is None:
            return None
        if code != 0 and self._proc.stderr is not None:
            last = (self._proc.stderr.read() or b"").decode(errors="replace").strip().splitlines()[-1:]
            log.warning("storage probe of %s failed: %s", self.where, last[0] if last else f"exit {code}")
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        return code == 0

    def wait(self, timeout: float) -> bool | None:
        """Wait at most ``timeout`` seconds; None if it is still stuck (it is left running)."""
        end = time.monotonic() + timeout
        while (answer := self.poll()) is None and time.monotonic() < end:
            time.sleep(0.01)
        return answer


@dataclass
class TierHealth:
    """The health of one rank's tier-1 storage (see the module docstring)."""

    where: Path  # the directory probed (under checkpoint.local.dir)
    probe_interval_s: float
    healthy: bool = True
    reason: str | None = None
    since: float | None = None  # time.monotonic() it became unhealthy
    _probe: StorageProbe | None = None
    _last_probe: float = 0.0

    def mark_stalled(self, reason: str) -> bool:
        """Unhealthy from now on (until a probe answers); True if it was healthy until now."""
        was = self.healthy
        self.healthy, self.reason = False, reason
        if was:
            self.since = self._last_probe = time.monotonic()
            if self._probe is None:  # at once: it answers the moment the storage does
                self._probe = StorageProbe(self.where)
        return was

    def check_now(self, timeout: float) -> bool:
        """One probe, waited for at most ``timeout`` seconds (start of an attempt, before the
        restore reads the tier): False, and the tier unhealthy, if the storage did not answer."""
        probe = StorageProbe(self.where)
        answer = probe.wait(timeout)
        if answer:
            return True
        why = "did not answer" if answer is None else "answered with an error"
        if answer is None:
            self._probe = probe  # still running: usable() reads its exit later
        self.mark_stalled(f"{STALLED}: a probe write of {self.where} {why} within {timeout:.1f}s")
        return False

    def usable(self) -> bool:
        """Non-blocking: healthy now? While unhealthy, start or read a probe (see the docstring)."""
        if self.healthy:
            return True
        if self._probe is not None:
            answer = self._probe.poll()
            if answer is None:
                return False
            self._probe = None
            if answer:
                log.warning(
                    "tier 1 storage answers again (probe of %s) after %.0fs stalled (%s): its saves resume",
                    self.where,
                    time.monotonic() - (self.since or time.monotonic()),
                    self.reason,
                )
                self.healthy, self.reason, self.since = True, None, None
                return True
        if time.monotonic() - self._last_probe >= self.probe_interval_s:
            self._last_probe = time.monotonic()
            self._probe = StorageProbe(self.where)
        return False


class TierStalled(PublishError):
    """A save not even started: some rank's tier-1 storage is stalled (the tier is skipped until
    every rank's probe answers). Reported as a skip, never as a failed save, and never stops the job."""
