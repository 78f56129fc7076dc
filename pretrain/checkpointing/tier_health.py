"""Whether a tier's storage answers (tier 1's node-local volume, the reshardable tier's shared file
system): the deadline of its saves, the tier marked unhealthy when one passes, and the probe that
marks it healthy again. Nothing here can block the training thread.

A stalled file system (an NFS or Lustre server that stopped answering, a FUSE daemon that hangs)
does not fail a write: the write waits in the kernel, uninterruptibly, for as long as the storage
stalls, and a process with a thread stuck there cannot even finish exiting. So:

* :func:`stall_deadline`: the seconds a save (tier 1: write, commit, replication; reshardable: the
  background write) may take before its tier counts as stalled: the tier's ``stall_timeout_s``
  when set, else ``max(STALL_FLOOR_S, STALL_FACTOR x the slowest save of this attempt)``.
* :class:`StorageProbe`: a small write, fsync, rename and delete under the tier's directory, done
  by a spawned process (a fresh interpreter without torch: it never forks a CUDA process). The
  rank waits for it at most a deadline and never joins it: a probe stuck in the kernel stays
  behind as its own process, which exits when the storage answers, never as a thread of the rank.
* :class:`WriteProgress`: whether a background writer process (and what it started) still writes,
  read from ``/proc`` without touching the storage: the reshardable tier's deadline counts from
  the writer's last written byte, so a slow but moving write of a large step is never a stall.
* :class:`TierHealth`: healthy, or unhealthy since when and why. :meth:`TierHealth.usable` is
  non-blocking: a probe starts the moment the tier turns unhealthy (a stuck one answers as soon
  as the storage does), then at most every ``probe_interval_s`` after one that failed; reading
  the last one's exit is all it does, and an answer makes the tier healthy again.

* :class:`AgreedTierHealth`: the one rule every tier follows (tier 1 and the reshardable tier),
  made collective: the deadline, the start-of-attempt probe, the skip of a save while any rank's
  storage is stalled, the restore's question, and :class:`WriteWatch`, the verdict on a background
  write (stalled only when the writer has written nothing for the deadline *and* a probe of its
  storage then goes unanswered for the deadline too: a slow write on storage that answers is
  never abandoned). Every question is answered the same on every rank, so no rank takes a
  collective the others skip. ``probes``: whether this rank probes; the reshardable tier probes
  from one rank per node (a node's ranks share its mount; thousands of probes at once would be a
  metadata storm on a shared file system), tier 1 from every rank (each owns its writer).

Time and probes are collaborators (``clock``, ``new_probe``), so every verdict is tested in one
process on a fake clock (tests/test_tier_health.py). The callers
(:class:`pretrain.checkpointing.per_rank.PerRankCheckpoints`,
:class:`pretrain.checkpointing.reshardable.ReshardableCheckpoints`) decide what a stall means for
the job: they abandon the stuck writer and report it (:func:`log_stall`, the metric, the alert).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tiering.collective import Collective
from tiering.errors import PublishError

log = logging.getLogger(__name__)

STALL_FLOOR_S = 60.0  # no deadline below this unless configured: a busy NVMe can take seconds
STALL_FACTOR = 10.0  # x the slowest save seen: a 10x slowdown is a stall, not a slow disk
STALLED = "stalled"  # how a stalled save's message starts (and its failure reason)
DISK_FULL = "disk_full"  # the reason of a save (or of the room made for one) that found its volume full
START_PROBE_S = 30.0  # the longest the start of an attempt waits for a probe (the setup section must not pass first)

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


class Probe(Protocol):
    """One probe of a tier's storage under way: :class:`StorageProbe`, or a test's."""

    started: float  # on the health's clock

    def poll(self) -> bool | None: ...

    def wait(self, timeout: float) -> bool | None: ...


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


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (``/proc/<pid>/task/*/children``); [] once ``pid`` is gone.
    Not psutil's ``children(recursive=True)``: that reads every process's ``stat`` on the host to
    build a parent map, and this runs at every poll of a background save (each step, every 10 ms
    in a blocking wait); this reads the writer's subtree only."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = list((Path("/proc") / str(current) / "task").iterdir())
            children = [int(c) for task in tasks for c in task.joinpath("children").read_text().split()]
        except (OSError, ValueError):
            if current == pid:
                return []
            continue  # a descendant ended between the listing and the read
        found.append(current)
        pending += [c for c in children if c not in found]
    return found


def written_bytes(pid: int) -> int | None:
    """What ``pid`` and its descendants have written so far: bytes passed to ``write()`` (``wchar``,
    counted when a call returns) plus bytes dirtied in the page cache (``write_bytes``, counted as
    a large write proceeds); None once ``pid`` is gone or ``/proc`` cannot say. A write stuck in
    the kernel adds nothing."""
    tree = process_tree(pid)
    total = 0
    for current in tree:
        try:
            io = (Path("/proc") / str(current) / "io").read_text().splitlines()
        except OSError:
            if current == pid:
                return None
            continue
        total += sum(int(line.split()[1]) for line in io if line.startswith(("wchar:", "write_bytes:")))
    return total if tree else None


class Progress(Protocol):
    """How long a background writer has written nothing: :class:`WriteProgress`, or a test's."""

    def idle_s(self) -> float: ...

    def restart(self) -> None: ...


class WriteProgress:
    """Seconds since a background writer last wrote (see :func:`written_bytes`); ``restart`` starts
    the count again (the storage answered a probe: the writer is slow, not stalled)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._written: int | None = None
        self._since = time.monotonic()

    def idle_s(self) -> float:
        now = written_bytes(self.pid)
        if now is not None and now != self._written:
            self._written, self._since = now, time.monotonic()
        return time.monotonic() - self._since

    def restart(self) -> None:
        self._since = time.monotonic()


@dataclass
class TierHealth:
    """The health of one rank's storage of a tier (see the module docstring)."""

    where: Path  # the directory probed (under the tier's directory)
    probe_interval_s: float
    label: str = "tier 1"  # how log lines name the tier
    healthy: bool = True
    reason: str | None = None
    since: float | None = None  # when it became unhealthy (on ``clock``)
    clock: Callable[[], float] = time.monotonic
    new_probe: Callable[[Path], Probe] = field(default=StorageProbe, repr=False)
    _probe: Probe | None = None
    _last_probe: float = 0.0

    def mark_stalled(self, reason: str, probe: Probe | None = None) -> bool:
        """Unhealthy from now on (until a probe answers: ``probe``, one already waiting on the
        storage, or a new one); True if it was healthy until now."""
        was = self.healthy
        self.healthy, self.reason = False, reason
        if was:
            self.since = self._last_probe = self.clock()
            if self._probe is None:  # at once: it answers the moment the storage does
                self._probe = probe if probe is not None else self.new_probe(self.where)
        return was

    def check_now(self, timeout: float) -> bool:
        """One probe, waited for at most ``timeout`` seconds (start of an attempt, before the
        restore reads the tier): False, and the tier unhealthy, if the storage did not answer."""
        probe = self.new_probe(self.where)
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
                    "%s storage answers again (probe of %s) after %.0fs stalled (%s): its saves resume",
                    self.label,
                    self.where,
                    self.clock() - (self.since or self.clock()),
                    self.reason,
                )
                self.healthy, self.reason, self.since = True, None, None
                return True
        if self.clock() - self._last_probe >= self.probe_interval_s:
            self._last_probe = self.clock()
            self._probe = self.new_probe(self.where)
        return False


def log_stall(rank: int, label: str, where: Path, what: str, setting: str, probe_interval_s: float) -> None:
    """The one line a rank logs when a tier's storage stops answering (``setting``: the tier's
    config section, e.g. ``checkpoint.local``)."""
    log.error(
        "rank %d: %s storage %s is stalled: %s; the tier is skipped (training goes on with the other tiers) "
        "and probed every %.0fs until it answers; fix: check the file system under %s.dir (mount, NFS/Lustre "
        "server, disk), or raise %s.stall_timeout_s if saves there are legitimately this slow",
        rank,
        label,
        where,
        what.removeprefix(f"{STALLED}: "),
        probe_interval_s,
        setting,
        setting,
    )


class TierStalled(PublishError):
    """A save not even started: some rank's storage of that tier is stalled (the tier is skipped until
    every rank's probe answers). Reported as a skip, never as a failed save, and never stops the job."""


class AgreedTierHealth:
    """One tier's storage health, every verdict the same on every rank (see the module docstring)."""

    def __init__(
        self,
        health: TierHealth,
        coll: Collective,
        stall_timeout_s: float | None,
        report: Callable[[str], None],
        probes: bool = True,
    ) -> None:
        """``health``: this rank's (its label names the tier in every message); ``report``: the one
        line a probing rank logs when its storage stalls; ``probes``: whether this rank probes."""
        self.health = health
        self.coll = coll
        self.stall_timeout_s = stall_timeout_s
        self.report = report
        self.probes = probes
        self._slowest_s = 0.0  # the slowest save of this attempt (agreed where ``agree_slowest`` is used)

    @property
    def healthy(self) -> bool:
        """This rank's storage, as last known (read, never probed: no storage call)."""
        return self.health.healthy

    def deadline(self) -> float:
        """Seconds a save (or the start-of-attempt probe) may take before the storage counts as stalled."""
        return stall_deadline(self.stall_timeout_s, self._slowest_s)

    def saved(self, seconds: float) -> None:
        """This rank's save took ``seconds``: the default deadline grows with the slowest."""
        self._slowest_s = max(self._slowest_s, seconds)

    def agree_slowest(self, seconds: float) -> None:
        """Collective (every rank, after each published save): as :meth:`saved`, with the slowest
        of every rank (each rank's clock differs), so the deadline is the same everywhere."""
        self._slowest_s = max(self._slowest_s, max(self.coll.all_gather(seconds)))

    def probe_at_start(self) -> bool:
        """Collective: did every probing rank's storage answer within the deadline (at most
        START_PROBE_S)? A rank whose probe did not is marked stalled and reports it."""
        ok = self.health.check_now(min(self.deadline(), START_PROBE_S)) if self.probes else True
        if all(self.coll.all_gather(ok)):
            return True
        if not ok:
            self.report(self.health.reason or STALLED)
        return False

    def agreed_healthy(self) -> str | None:
        """Collective, non-blocking (a stalled rank's probe runs in the background, see
        :meth:`TierHealth.usable`): None if every rank may touch the tier now; else why not, the
        same line on every rank, naming the first stalled rank. One flag gathered per question
        (before every save); the reasons only while some rank is stalled."""
        usable = self.health.usable()
        if all(self.coll.all_gather(usable)):
            return None
        reasons = self.coll.all_gather(None if usable else (self.health.reason or STALLED))
        stalled = [(rank, why) for rank, why in enumerate(reasons) if why is not None]
        return f"rank {stalled[0][0]}: {stalled[0][1]}" if stalled else None

    def skip_if_stalled(self, step: int) -> None:
        """Collective: a save is not even started while any rank's storage is stalled."""
        why = self.agreed_healthy()
        if why is not None:
            raise TierStalled(f"{self.health.label} save of step {step} skipped: {why}")

    def stalled(self, what: str, probe: Probe | None = None) -> bool:
        """A save of this rank was abandoned: a probing rank marks its storage stalled (``probe``:
        its own that has not answered, kept as the one that tells when the storage answers) and
        reports it once; True if it was healthy until now."""
        if self.probes and self.health.mark_stalled(what, probe):
            self.report(what)
            return True
        return False

    def watch(self, progress: Progress | None) -> WriteWatch:
        """The verdict on one background write whose writer's progress is ``progress`` (None where
        ``/proc`` cannot follow the writer: no deadline then)."""
        return WriteWatch(self, progress)


class WriteWatch:
    """One background save's stall verdict (see the module docstring), asked at every poll."""

    def __init__(self, agreed: AgreedTierHealth, progress: Progress | None) -> None:
        self.h = agreed
        self.progress = progress
        self.confirm: Probe | None = None  # a probing rank's probe once some writer went idle
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
        health = self.h.health
        if self.confirm is None:
            try:
                self.confirm = health.new_probe(health.where)
            except OSError:  # no process to spare now: asked again at the next poll (never one rank's raise)
                return 0
        if self.confirm.poll() is None:
            return int((health.clock() - self.confirm.started) * 1000)
        self.confirm = None
        return -1
