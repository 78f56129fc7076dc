"""Whether the reshardable tier's shared storage answers, agreed by every rank.

Shared storage stalls (an NFS or Lustre server that stops answering): a write there waits in the
kernel for as long as it does. :class:`SharedStorageHealth` is the reshardable tier's
:class:`~pretrain.checkpointing.tier_health.TierHealth`, made collective:

* one rank per node probes (its first local rank: a node's ranks share its mount, and thousands
  of probes at once would be a metadata storm on a shared file system), under the tier's run
  directory; every question the tier asks (:meth:`probe_at_start`, :meth:`agreed_healthy`,
  :meth:`skip_if_stalled`, :meth:`WriteWatch.verdict`) is answered the same on every rank, so no
  rank takes a collective the others skip;
* a background save is stalled when some rank's writer (Megatron's forked process and the
  workers it starts) has written nothing for the deadline *and* a probe of that node's storage
  then goes unanswered for the deadline too: a save that is merely slow (one huge write, a long
  fsync) on storage that still answers is never abandoned;
* the deadline is ``checkpoint.reshardable.stall_timeout_s``, else ``max(60 s, 10 x`` the slowest
  save of the attempt, agreed across ranks ``)``; the start-of-attempt probe waits at most
  ``START_PROBE_S`` of it (a 4 KB write that takes longer is a stall; the ``setup`` section
  timeout must not pass first).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pretrain.checkpointing.tier_health import STALLED, StorageProbe, TierHealth, TierStalled, WriteProgress
from pretrain.checkpointing.tier_health import stall_deadline as _stall_deadline
from tiering.collective import Collective

RESHARDABLE_SKIPPED = "reshardable tier skipped"  # how a restore says it did not wait on a stalled tier
START_PROBE_S = 30.0  # the longest the start of an attempt waits for the probe


class SharedStorageHealth:
    def __init__(
        self,
        run_dir: Path,
        coll: Collective,
        stall_timeout_s: float | None,
        probe_interval_s: float,
        report: Callable[[str], None],
    ) -> None:
        """``report``: the one line a probing rank logs when its storage stalls."""
        self.coll = coll
        self.stall_timeout_s = stall_timeout_s
        self.health = TierHealth(run_dir / ".health" / f"probe-{coll.rank:05d}", probe_interval_s, "reshardable tier")
        self.probes = os.environ.get("LOCAL_RANK", "0") == "0"
        self.report = report
        self._slowest_s = 0.0  # the slowest save of this attempt, the same on every rank

    def deadline(self) -> float:
        return _stall_deadline(self.stall_timeout_s, self._slowest_s)

    def saved(self, seconds: float) -> None:
        """Collective (every rank, after each published save): the default deadline grows with the
        slowest save, agreed (each rank's clock differs)."""
        self._slowest_s = max(self._slowest_s, max(self.coll.all_gather(seconds)))

    def probe_at_start(self) -> bool:
        """Collective: did every node's probe answer within the deadline (at most START_PROBE_S)?"""
        ok = self.health.check_now(min(self.deadline(), START_PROBE_S)) if self.probes else True
        if all(self.coll.all_gather(ok)):
            return True
        if not ok:
            self.report(self.health.reason or STALLED)
        return False

    def agreed_healthy(self) -> str | None:
        """Collective: None if every rank may touch the tier now (read, not probed: the restore asks
        it once and then leaves a stalled tier alone); else why not, the same line on every rank."""
        reasons = self.coll.all_gather(None if self.health.healthy else (self.health.reason or STALLED))
        stalled = [(rank, why) for rank, why in enumerate(reasons) if why is not None]
        return f"{RESHARDABLE_SKIPPED}: rank {stalled[0][0]}: {stalled[0][1]}" if stalled else None

    def skip_if_stalled(self, step: int) -> None:
        """Collective: a save is not even started while any node's storage is stalled (a stalled
        node's probe runs in the background meanwhile; see TierHealth.usable)."""
        if not all(self.coll.all_gather(self.health.usable())):
            why = self.health.reason or "another node's reshardable storage is stalled"
            raise TierStalled(f"reshardable save of step {step} skipped: {why}")

    def stalled(self, what: str, probe: StorageProbe | None) -> None:
        """A save was abandoned: a probing rank marks its storage stalled (``probe``: its own that
        has not answered, kept as the one that tells when the storage answers)."""
        if self.probes and self.health.mark_stalled(what, probe):
            self.report(what)

    def watch(self, writer_pid: int | None) -> WriteWatch:
        return WriteWatch(self, WriteProgress(writer_pid) if writer_pid is not None else None)


class WriteWatch:
    """One background save's stall verdict (see the module docstring), asked at every poll."""

    def __init__(self, health: SharedStorageHealth, progress: WriteProgress | None) -> None:
        self.h = health
        self.progress = progress
        self.confirm: StorageProbe | None = None  # a probing rank's probe once some writer went idle
        self.longest_idle_s = 0.0  # the idlest rank's writer at the last verdict, the same on every rank

    def verdict(self, writer_ended: bool) -> str | None:
        """Collective: None while no writer is stalled; else the stall, in one line. One integer
        gathered per poll; a second gather only while some writer is idle past the deadline."""
        deadline_ms = int(self.h.deadline() * 1000)
        # An ended writer is not idle; where /proc cannot follow a writer there is no deadline (a
        # stall then holds the next blocking wait until the section timeout ends the rank).
        idle_ms = 0 if writer_ended or self.progress is None else int(self.progress.idle_s() * 1000)
        left_ms = self.h.coll.min_int(deadline_ms - idle_ms)
        self.longest_idle_s = (deadline_ms - left_ms) / 1000
        if left_ms >= 0:
            return None
        rows = self.h.coll.all_gather((idle_ms, self._unanswered_ms()))
        unanswered = [(rank, ms) for rank, (_, ms) in enumerate(rows) if ms >= deadline_ms]
        if unanswered:
            idle_rank = max(range(len(rows)), key=lambda r: rows[r][0])
            return (
                f"{STALLED}: rank {idle_rank}'s writer wrote nothing for {rows[idle_rank][0] / 1000:.1f}s and "
                f"rank {unanswered[0][0]}'s probe of the storage went unanswered for "
                f"{unanswered[0][1] / 1000:.1f}s (deadline {deadline_ms / 1000:.1f}s)"
            )
        answered = all(ms <= 0 for _, ms in rows) and any(ms < 0 for _, ms in rows)
        if answered and self.progress is not None:  # the storage is alive: the writer is only slow
            self.progress.restart()
        return None

    def _unanswered_ms(self) -> int:
        """A probing rank's probe: ms it has gone unanswered, or -1 once it answered (the next
        call starts another); 0 on the others."""
        if not self.h.probes:
            return 0
        if self.confirm is None:
            try:
                self.confirm = StorageProbe(self.h.health.where)
            except OSError:  # no process to spare now: asked again at the next poll (never one rank's raise)
                return 0
        if self.confirm.poll() is None:
            return int((time.monotonic() - self.confirm.started) * 1000)
        self.confirm = None
        return -1
