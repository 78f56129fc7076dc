"""A rank that stopped living while its peers go on, found from outside the rank in seconds.

A thread of every rank touches its node-local pulse file every ``PULSE_S``
(:mod:`pretrain.resilience.phases`). A rank stopped (SIGSTOP), or deadlocked with its GIL held,
stops pulsing; its peers, blocked in the next collective with the GIL released, go on pulsing. The
NVRx section timeouts find such a rank only after the step timeout (60 s until steps are measured,
then 20 x the slowest step). :class:`HangWatch` runs in the node's agent process (outside every
rank, so a held GIL cannot stop it) and reads the pulses of the run's ranks on its node every
``interval``: a rank whose pulse is older than ``threshold_s`` while another rank of the run on the
node pulsed within ``FRESH_S``, whose process is still the one that pulsed and whose phase record
says ``training``, is SIGKILLed. The launcher then restarts the group at once, and the attempt's
diagnosis (:func:`pretrain.resilience.attempts.diagnose`) names the rank hung from the
``hang_killed`` event the watch writes (the rank, its process, how long it was silent).

``auto`` (the default): each rank's own limit, ``max(3 x its p99 step, 2 s)`` over its step
intervals (saves included), measured once ``calculate_timeouts_after`` steps ran and again every
as many steps (loaded from the checkpoint it restored until then), kept in its phase record
(``hang_watch_s``); :class:`RankLimit` is the rank's side. Until a rank's limit is known the
watch leaves it to NVRx's timeouts. A single C call that holds the GIL longer than the limit
stops the pulse too, so ``auto`` stays off where the training thread itself writes a checkpoint
(a ``thread`` tier-1 writer: GPU): set seconds there.

Never: kills a rank in start-up or recovery (long native calls there may hold the GIL), when no
other rank of the node pulses (a paused node, or one rank per node: NVRx's timeouts stay the
judge), or a process other than the one whose pid the pulse file holds. :func:`hung` is the rule,
pure, tested in one process at its boundaries.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import stat
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pretrain.observability.runlog import append_jsonl
from pretrain.platform.procfs import is_running
from pretrain.resilience.phases import PULSE_ROOT, pulse_path, ranks_dir

log = logging.getLogger(__name__)

FRESH_S = 1.0  # another rank pulsed this recently: the node and its peers are alive
AUTO = "auto"
AUTO_FLOOR_S = 2.0  # ten pulses: a busy node must not read as a hang
AUTO_STEP_FACTOR = 3.0  # x the p99 step: a step may take three times its usual worst
AUTO_WINDOW = 200  # the step intervals a limit is measured over
# Between two looks at the pulses: half of it, on average, is added to a hang's detection. A look
# is a listing and two small reads per rank of the node (~0.1 ms each).
SCAN_S = 0.1

HangSetting = float | Literal["auto"]  # fault_tolerance.hang_watch_s


def hung(pulses: dict[int, float], now: float, threshold_s: float) -> list[int]:
    """The ranks whose last pulse (``pulses``: rank -> its time) is older than ``threshold_s``
    while another rank pulsed within ``FRESH_S``; none when no rank is fresh."""
    if not any(now - t <= FRESH_S for t in pulses.values()):
        return []
    return sorted(r for r, t in pulses.items() if now - t > threshold_s)


def auto_limit(step_seconds: Sequence[float]) -> float:
    """``max(3 x the p99 of step_seconds, 2 s)``."""
    ordered = sorted(step_seconds)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0
    return round(max(AUTO_FLOOR_S, AUTO_STEP_FACTOR * p99), 3)


class RankLimit:
    """A rank's side of ``auto``: the intervals between its steps' starts (the last
    ``AUTO_WINDOW``), and its limit: ``loaded`` from the checkpoint it restored, at once; measured
    once ``measure_after`` intervals were seen, then again every ``measure_after`` steps (a machine
    that got busier, or quieter), kept when within 10 % of the limit in force."""

    def __init__(self, measure_after: int, loaded: float | None = None) -> None:
        self.measure_after = max(1, measure_after)
        self.limit = loaded
        self._intervals: deque[float] = deque(maxlen=AUTO_WINDOW)
        self._last: float | None = None
        self._steps = 0
        self._next_measure = 0
        self._told = False

    def step_started(self, now: float) -> float | None:
        """At each step's start: the limit when it is new (first known, or measured anew), else None."""
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now
        self._steps += 1
        if len(self._intervals) >= self.measure_after and self._steps >= self._next_measure:
            self._next_measure = self._steps + self.measure_after
            fresh = auto_limit(self._intervals)
            if self.limit is None or abs(fresh - self.limit) > 0.1 * self.limit:
                self.limit, self._told = fresh, True
                return fresh
        if self.limit is None or self._told:
            return None
        self._told = True
        return self.limit


class HangWatch:
    """Reads the pulses of the run at ``run_dir`` on this node; kills the ranks :func:`hung` names
    (``threshold_s``: seconds, or ``auto``: each rank's limit from its phase record)."""

    def __init__(
        self, run_dir: Path, threshold_s: HangSetting, interval_s: float = SCAN_S, pulse_root: Path = PULSE_ROOT
    ) -> None:
        self.run_dir = Path(run_dir)
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.folder = pulse_path(self.run_dir, 0, pulse_root).parent
        self.killed: list[tuple[int, int]] = []  # (rank, pid) of every rank this watch killed

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            try:
                self.scan()
            except OSError as exc:  # a vanishing file between listing and reading: look again
                log.debug("hang watch: %s", exc)

    def scan(self, now: float | None = None) -> list[int]:
        """One look: kill every hung rank in training; returns the ranks killed."""
        pids, pulses = self._pulses()
        now = time.time() if now is None else now
        killed = []
        auto = self.threshold_s == AUTO
        for rank in hung(pulses, now, AUTO_FLOOR_S if auto else float(self.threshold_s)):
            pid = pids[rank]
            if (rank, pid) in self.killed or not is_running(pid):
                continue
            record = self._record(rank, pid)
            limit = record.get("hang_watch_s") if auto else self.threshold_s
            if record.get("phase") != "training" or limit is None or now - pulses[rank] <= float(limit):
                continue  # not training, its limit not known yet, or within it
            os.kill(pid, signal.SIGKILL)
            self.killed.append((rank, pid))
            killed.append(rank)
            stale = now - pulses[rank]
            log.warning("hang watch: rank %d (pid %d) silent for %.1fs while its peers pulse: killed", rank, pid, stale)
            append_jsonl(
                self.run_dir / "events.jsonl",
                {"event": "hang_killed", "rank": rank, "pid": pid, "stale_s": round(stale, 2), "time": now},
            )
        return killed

    def _pulses(self) -> tuple[dict[int, int], dict[int, float]]:
        """Every pulse file of the run on this node: rank -> pid, rank -> last pulse time."""
        pids: dict[int, int] = {}
        times: dict[int, float] = {}
        for path in self.folder.glob("rank-*.pulse") if self.folder.is_dir() else []:
            try:
                st = path.lstat()
                if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                    continue  # only this user's pulses may get a rank killed
                rank = int(path.stem.removeprefix("rank-"))
                pid = int(path.read_text() or -1)
                mtime = st.st_mtime
            except (OSError, ValueError):
                continue
            if pid > 0 and is_running(pid):  # a rank that ended is the launcher's business
                pids[rank], times[rank] = pid, mtime
        return pids, times

    def _record(self, rank: int, pid: int) -> dict[str, Any]:
        """The rank's phase record, when it is that process's; else empty."""
        try:
            record = json.loads((ranks_dir(self.run_dir) / f"rank-{rank:05d}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) and record.get("pid") == pid else {}
